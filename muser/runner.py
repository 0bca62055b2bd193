"""The runner: turns sequences into device tensors, runs one forward step, commits metadata.

Only the runner touches device tensors; callers pass host integers and token ids. A sequence's
placement (muser/kvcache/placement.py: slot, ring, pages, rows cached) is the caller's object,
which the runner places, grows and frees in place; the runner keeps the pool's tensors, keyed by
slot and page ids, and nothing per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muser import ops
from muser.attention.decode_meta import prepare_plan
from muser.attention.plan import SeqInput, plan_step
from muser.config import EngineConfig, ModelConfig
from muser.graph.decoder import Decoder
from muser.graph.weights import ModelWeights
from muser.graphs import DecodeGraphs
from muser.kvcache.pages import OutOfPages, PageAllocator
from muser.kvcache.placement import Placement
from muser.kvcache.pool import KVPool
from muser.kvcache.reuse import CHECKPOINT_EVERY, PrefixCache
from muser.kvcache.ring import RingState
from muser.memory import MemoryReport
from muser.ops import kv_fp8
from muser.startup_record import StartupRecord


@dataclass(slots=True)
class Ahead:
    """A decode step queued before the host knew its tokens (Runner.forward_ahead)."""

    seqs: list[Placement]
    logits: torch.Tensor  # [len(seqs), vocab] float32 on the device
    rings: list[RingState]  # each sequence's ring after the step
    new_pages: list[int]  # pages reserved for it, per sequence


class Runner:
    def __init__(self, cfg: ModelConfig, engine: EngineConfig, weights: ModelWeights) -> None:
        """The runner's pool, model and (on a GPU) graphs, not yet warmed up: muser/startup/
        drives it ready to serve (`muser.startup.start.start`) and hands it the record."""
        self.cfg, self.engine = cfg, engine
        self.device = torch.device(engine.device)
        self.tile = 128 if self.device.type == "cpu" else 64
        self.pages_per_seq = pages_per_seq = -(-engine.max_model_len // engine.page_size)
        num_pages = engine.num_pages or engine.max_num_seqs * pages_per_seq
        if self.device.type == "cuda" and engine.num_pages is None:
            # NOTE: enough for any warm-up step (one full-length sequence, or fresh sequences
            # of max_batched_tokens rows, a partial page each); sized after it
            # (muser/startup/memory.py)
            per_step = -(-engine.max_batched_tokens // engine.page_size) + engine.max_num_seqs
            num_pages = min(max(pages_per_seq, per_step), num_pages)
        # NOTE: a verify pass stores its drafts' rows before it knows which hold: the ring
        # keeps num_speculative_tokens rows past the window, so rejected ones never overwrite
        # a row still inside a later row's window
        ring_capacity = cfg.sliding_window + (
            engine.num_speculative_tokens if engine.speculative != "none" else 0)
        fp8 = engine.kv_dtype == "fp8"  # packed rows of codes and scales (muser/ops/kv_fp8.py)
        self.pool = KVPool(
            cfg, engine.max_num_seqs, ring_capacity, num_pages, engine.page_size,
            kv_fp8.STORE_DTYPE if fp8 else getattr(torch, engine.kv_dtype), self.device,
            row_pad=kv_fp8.PAD if fp8 else 0,
        )
        self.pages = PageAllocator(num_pages)
        # NOTE: before the warm-up, so that the GPU's pages are sized beside the store; no more
        # checkpoints than two for each page the pool may get (a sequence that ends leaves
        # two: its prompt's end and its own, so even one page of one slot serves the same
        # prompt again)
        self.prefix = PrefixCache(
            self.pool, self.pages, int(engine.prefix_cache_gb * 2**30),
            2 * engine.max_num_seqs * pages_per_seq,
            int(engine.kv_host_gb * 2**30)) if engine.prefix_cache else None
        # NOTE: on a GPU the eager decode group's block table is as wide as a graph's, so its
        # kernel shapes depend on the batch size only (each seen by the warm-up)
        self._decode_table_width = pages_per_seq if self.device.type == "cuda" else None
        self.free_slots = list(range(engine.max_num_seqs - 1, -1, -1))
        backend = ops.backend(self.device)
        self.model = Decoder(cfg, backend.prepare_weights(weights), self.pool, backend)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not engine.enforce_eager:
            self.graphs = DecodeGraphs(cfg, self.model, engine.max_num_seqs, ring_capacity,
                                       engine.page_size, pages_per_seq, self.device)
        self.startup: StartupRecord | None = None  # what getting ready did (muser/startup/)

    def ready(self, startup: StartupRecord) -> None:
        """Take the record of getting ready (muser/startup/start.py)."""
        self.startup = startup

    @property
    def memory(self) -> MemoryReport:
        """What each category holds (the startup's report)."""
        if self.startup is None:
            raise RuntimeError("the runner has no memory report before muser.startup starts it")
        return self.startup.memory

    def resize_pages(self, num_pages: int) -> None:
        """Reallocate the KV pages to `num_pages` (the startup sizes them), every page free."""
        self.pool.allocate_pages(num_pages)
        self.pages = PageAllocator(num_pages)
        if self.prefix is not None:
            self.prefix.reset(self.pages)

    def allocate(self, token_ids: list[int] | None = None, count: bool = True,
                 seq: Placement | None = None, slot: int | None = None) -> Placement:
        """`seq` (unplaced; default a new one) placed in free slot `slot` (default: the free
        slot freed last) -> it: empty, or (with the prefix cache) holding the longest cached
        prefix of `token_ids[:-1]` (then `num_cached` > 0; `count`: as a prompt's lookup in the
        prefix cache's counters)."""
        if not self.free_slots:
            raise RuntimeError("no free sequence slot")
        if slot is not None and slot not in self.free_slots:
            raise RuntimeError(f"sequence slot {slot} is not free")
        seq = Placement() if seq is None else seq
        assert not seq.is_placed and not seq.num_cached and not seq.page_ids, "placed already"
        if slot is None:
            slot = self.free_slots[-1]
        self.free_slots.remove(slot)
        seq.slot, seq.ring = slot, RingState(self.pool.ring_capacity)
        if self.prefix is not None and token_ids:
            self.prefix.restore(seq, token_ids, count)
        return seq

    def fork(self, seq: Placement, into: Placement | None = None) -> Placement:
        """`into` (unplaced; default a new one) placed in a free slot holding what `seq` holds
        -> it: `seq`'s full pages shared by reference (read-only: a sequence only appends), its
        partial last page and its sliding rings copied. Raises RuntimeError (no free slot) or
        OutOfPages, taking nothing."""
        if not self.free_slots:
            raise RuntimeError("no free sequence slot")
        into = Placement() if into is None else into
        assert not into.is_placed and not into.num_cached, "placed already"
        full = seq.num_cached // self.engine.page_size
        tail = self.pages.allocate(1) if seq.num_cached % self.engine.page_size else []
        slot = self.free_slots.pop()
        shared = seq.page_ids[:full]
        self.pages.share(shared)
        self.pool.copy_slot(seq.slot, slot, seq.page_ids[full] if tail else None,
                            tail[0] if tail else None)
        into.slot, into.ring, into.num_cached = slot, seq.ring, seq.num_cached
        into.page_ids, into.token_ids, into.keys = shared + tail, list(seq.token_ids), list(
            seq.keys)
        return into

    def free(self, seq: Placement) -> None:
        """Release the sequence's slot and pages, leaving it unplaced and empty (with the prefix
        cache: its pages stay cached and its state at its end is checkpointed first)."""
        if self.prefix is not None:
            self.prefix.save(seq, final=True)
        self.pages.free(seq.page_ids)
        self.free_slots.append(seq.slot)
        seq.slot, seq.ring, seq.num_cached = None, None, 0
        seq.page_ids, seq.token_ids, seq.keys = [], [], []

    def num_freed_by(self, seq: Placement) -> int:
        """Pages `free(seq)` gives back (free or cached): those no other sequence holds."""
        return self.pages.num_freed_by(seq.page_ids)

    def prefill(self, seq: Placement, token_ids: list[int]) -> torch.Tensor:
        """Append a prompt to `seq` in chunks of prefill_chunk rows, as the engine serves one
        (no LM head on the chunks before the last) -> the logits of its last row [1, vocab]."""
        chunk = self.engine.prefill_chunk
        for start in range(0, len(token_ids), chunk):
            last = start + chunk >= len(token_ids)
            logits = self.forward([seq], [token_ids[start:start + chunk]],
                                  logit_rows=None if last else [])
        return logits

    def forward(
        self, seqs: list[Placement], token_ids: list[list[int]], all_logits: bool = False,
        logit_rows: list[int] | None = None, hold: list[int] = (),
    ) -> torch.Tensor:
        """forward_hidden's logits (no hidden rows asked)."""
        return self.forward_hidden(seqs, token_ids, all_logits, logit_rows, hold)[0]

    @torch.inference_mode()
    def forward_hidden(
        self, seqs: list[Placement], token_ids: list[list[int]], all_logits: bool = False,
        logit_rows: list[int] | None = None, hold: list[int] = (),
        hidden_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `token_ids[i]` to `seqs[i]` -> logits of each sequence's last row [B, vocab],
        of every new row [N, vocab] when `all_logits`, or of the given flat rows.

        One step may mix one-row sequences (decode) and chunks (prefill): the leading one-row
        sequences attend as one batched decode, each chunk by its own route. A step of one-row
        sequences only replays a CUDA graph when graphs are captured.

        hold: indices of sequences whose rows are computed (their K/V stored) but not committed:
        a verify pass's, whose caller commits the accepted ones (`accept`, then `trim`).
        hidden_rows: flat rows whose final hidden states (after the final norm) come back too,
        [len(hidden_rows), hidden] float32 (an embedding's rows; None: none, and the second
        item is None)."""
        for seq, ids in zip(seqs, token_ids):
            self.reserve(seq, seq.num_cached + len(ids))
        logits, rings, hidden = self._run(seqs, token_ids, None, all_logits, logit_rows,
                                          hidden_rows)
        for i, (seq, ids, ring) in enumerate(zip(seqs, token_ids, rings)):
            if i not in hold:
                self.commit(seq, ids, ring)
        return logits, hidden

    def accept(self, seq: Placement, token_id: int) -> None:
        """The next row a held forward computed for `seq` (its K/V stored) joins its cache.
        NOTE: the sliding ring holds window + num_speculative_tokens rows, so the rows of
        rejected drafts, stored past the accepted ones, overwrote only rows that have left
        every later row's window (docs/speculative-decoding.md)."""
        self.commit(seq, [token_id], seq.ring.advance(1))

    def trim(self, seq: Placement) -> None:
        """Give back the pages a held forward reserved past `seq`'s committed rows (its
        rejected drafts' rows, overwritten by the next ones)."""
        keep = -(-seq.num_cached // self.engine.page_size)
        if len(seq.page_ids) > keep:
            self.pages.free(seq.page_ids[keep:])
            del seq.page_ids[keep:]

    def truncate(self, seq: Placement, num_cached: int, ring: RingState) -> None:
        """`seq`'s cache back to its first `num_cached` rows, `ring` the state its ring had
        with them; pages past them given back (a draft model's drafts that did not hold,
        muser/engine/draft_model.py). NOTE: the sliding ring holds window +
        num_speculative_tokens rows, so the rows dropped, at most that many, overwrote only
        rows that have left every later row's window; the prefix cache's checkpoints would
        hold the dropped rows, so a runner that truncates has none."""
        assert self.prefix is None, "truncating a sequence the prefix cache records"
        assert num_cached <= seq.num_cached and ring.logical_end == num_cached, (
            num_cached, seq.num_cached, ring)
        assert seq.num_cached - num_cached <= self.engine.num_speculative_tokens
        seq.num_cached, seq.ring = num_cached, ring
        self.trim(seq)

    @torch.inference_mode()
    def forward_ahead(self, seqs: list[Placement], tokens: torch.Tensor) -> Ahead:
        """Queue the decode step that appends tokens[i] to seqs[i], the tokens [B] still on the
        device (sampled there, not yet known to the host) -> that step, to `commit_ahead` once
        they are. The caller has checked that a page is free for each sequence's next row."""
        new_pages = [self.pages_needed(seq, seq.num_cached + 1) for seq in seqs]
        for seq in seqs:
            self.reserve(seq, seq.num_cached + 1)
        logits, rings, _ = self._run(seqs, [[-1]] * len(seqs), tokens, False, None)
        return Ahead(seqs, logits, rings, new_pages)

    def commit_ahead(self, ahead: Ahead, i: int, token: int) -> None:
        """Row i of the step launched ahead appended `token` (now known) to ahead.seqs[i]."""
        self.commit(ahead.seqs[i], [token], ahead.rings[i])

    def _run(self, seqs: list[Placement], token_ids: list[list[int]], feed: torch.Tensor | None,
             all_logits: bool, logit_rows: list[int] | None,
             hidden_rows: list[int] | None = None) -> tuple[torch.Tensor, list,
                                                            torch.Tensor | None]:
        """Queue one step (pages reserved) -> (its logits, each sequence's ring after it, the
        final hidden states of `hidden_rows` or None). feed: one-row sequences' ids [B] on the
        device (token_ids then placeholders)."""
        inputs = [
            SeqInput(s.slot, s.num_cached, len(ids), s.ring, tuple(s.page_ids))
            for s, ids in zip(seqs, token_ids)
        ]
        flat = [t for ids in token_ids for t in ids]
        if self.graphs is not None and self.graphs.is_captured and hidden_rows is None and all(
                len(ids) == 1 for ids in token_ids):
            logits, rings = self.graphs.replay(inputs, flat, feed)
            return (logits if logit_rows is None else logits[logit_rows]), rings, None
        plan = plan_step(self.cfg, inputs, self.engine.page_size, self.tile, batch_decode=True)
        positions = [s.num_cached + i for s, ids in zip(seqs, token_ids) for i in range(len(ids))]
        lengths = torch.tensor([len(ids) for ids in token_ids])
        last_rows = torch.cumsum(lengths, 0) - 1
        if logit_rows is not None:
            rows = torch.tensor(logit_rows, dtype=torch.long)
        else:
            rows = torch.arange(len(flat)) if all_logits else last_rows
        plan, (ids_dev, positions_dev, rows_dev) = prepare_plan(
            plan, self.cfg, inputs, flat, self.engine.page_size, self.device,
            [torch.tensor(flat), torch.tensor(positions), rows], self._decode_table_width)
        if feed is not None:
            ids_dev = feed
        if hidden_rows is None:
            return self.model.forward(ids_dev, positions_dev, plan, rows_dev), plan.next_rings, None
        x = self.model.hidden(ids_dev, positions_dev, plan)
        hidden = x[torch.tensor(hidden_rows, dtype=torch.long, device=self.device)].float()
        return self.model.head(x, rows_dev), plan.next_rings, hidden

    def commit(self, seq: Placement, ids: list[int], ring: RingState) -> None:
        """`ids` are now in `seq`'s cache, its ring `ring` (after a step, or an install)."""
        seq.num_cached += len(ids)
        seq.ring = ring
        if self.prefix is not None:
            self.prefix.append(seq, ids)
            n = seq.num_cached
            if n == seq.prompt_end:
                # NOTE: protected, as a sequence's end is: on probation a full store evicted it
                # first, to make room for that very end
                self.prefix.save(seq, final=True)
            elif len(ids) > 1 and n % CHECKPOINT_EVERY == 0:
                self.prefix.save(seq)

    def reserve(self, seq: Placement, num_positions: int) -> None:
        """Pages for positions [0, num_positions) of `seq`; raises OutOfPages (taking none)."""
        if num_positions > self.engine.max_model_len:
            raise ValueError(
                f"sequence of {num_positions} tokens exceeds the context of "
                f"{self.engine.max_model_len}"
            )
        needed = self.pages_needed(seq, num_positions)
        if needed:
            seq.page_ids += self.pages.allocate(needed)

    def pages_needed(self, seq: Placement, num_positions: int) -> int:
        """Pages `seq` lacks for positions [0, num_positions)."""
        return max(0, -(-num_positions // self.engine.page_size) - len(seq.page_ids))


__all__ = ["Ahead", "OutOfPages", "Runner"]
