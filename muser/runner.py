"""The runner: turns sequences into device tensors, runs one forward step, commits metadata.

Only the runner touches device tensors; callers pass host integers and token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from muser import ops
from muser.attention.decode_meta import prepare_plan
from muser.attention.plan import SeqInput, plan_step
from muser.config import EngineConfig, ModelConfig
from muser.graph.decoder import Decoder
from muser.graph.weights import ModelWeights
from muser.graphs import DecodeGraphs
from muser.kvcache.pages import OutOfPages, PageAllocator
from muser.kvcache.pool import KVPool
from muser.kvcache.ring import RingState
from muser.startup import StartupLog


@dataclass(slots=True)
class SeqState:
    """One sequence's cache placement (host only)."""

    slot: int
    ring: RingState
    num_cached: int = 0
    page_ids: list[int] = field(default_factory=list)


class Runner:
    def __init__(self, cfg: ModelConfig, engine: EngineConfig, weights: ModelWeights,
                 log: StartupLog | None = None) -> None:
        """Ready to serve when it returns: on a GPU every kernel, projection pick and decode
        graph serving can use is compiled, chosen and captured (`muser/warmup.py`)."""
        self.cfg, self.engine = cfg, engine
        self.device = torch.device(engine.device)
        self.tile = 128 if self.device.type == "cpu" else 64
        pages_per_seq = -(-engine.max_model_len // engine.page_size)
        num_pages = engine.num_pages or engine.max_num_seqs * pages_per_seq
        self.pool = KVPool(
            cfg, engine.max_num_seqs, cfg.sliding_window, num_pages, engine.page_size,
            getattr(torch, engine.kv_dtype), self.device,
        )
        self.pages = PageAllocator(num_pages)
        self.free_slots = list(range(engine.max_num_seqs - 1, -1, -1))
        backend = ops.backend(self.device)
        self.model = Decoder(cfg, backend.prepare_weights(weights), self.pool, backend)
        self.graphs: DecodeGraphs | None = None
        self.warmup: dict = {}  # what each warm-up phase did (receipts)
        if self.device.type == "cuda" and not engine.enforce_eager:
            self.graphs = DecodeGraphs(cfg, self.model, engine.max_num_seqs, cfg.sliding_window,
                                       engine.page_size, pages_per_seq, self.device)
        if self.device.type == "cuda":
            from muser.warmup import prepare

            self.warmup = prepare(self, log)

    def allocate(self) -> SeqState:
        """A fresh sequence with an empty ring in a free slot."""
        if not self.free_slots:
            raise RuntimeError("no free sequence slot")
        return SeqState(slot=self.free_slots.pop(), ring=RingState(self.cfg.sliding_window))

    def free(self, seq: SeqState) -> None:
        self.pages.free(seq.page_ids)
        seq.page_ids = []
        self.free_slots.append(seq.slot)

    @torch.inference_mode()
    def forward(
        self, seqs: list[SeqState], token_ids: list[list[int]], all_logits: bool = False,
        logit_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Append `token_ids[i]` to `seqs[i]` -> logits of each sequence's last row [B, vocab],
        of every new row [N, vocab] when `all_logits`, or of the given flat rows."""
        for seq, ids in zip(seqs, token_ids):
            self._reserve_pages(seq, seq.num_cached + len(ids))
        inputs = [
            SeqInput(s.slot, s.num_cached, len(ids), s.ring, tuple(s.page_ids))
            for s, ids in zip(seqs, token_ids)
        ]
        flat = [t for ids in token_ids for t in ids]
        if self.graphs is not None and self.graphs.is_captured and all(
                len(ids) == 1 for ids in token_ids):
            logits, rings = self.graphs.replay(inputs, flat)
            for seq, ring in zip(seqs, rings):
                seq.num_cached += 1
                seq.ring = ring
            return logits if logit_rows is None else logits[logit_rows]
        plan = plan_step(self.cfg, inputs, self.engine.page_size, self.tile)
        positions = [s.num_cached + i for s, ids in zip(seqs, token_ids) for i in range(len(ids))]
        lengths = torch.tensor([len(ids) for ids in token_ids])
        last_rows = torch.cumsum(lengths, 0) - 1
        if logit_rows is not None:
            rows = torch.tensor(logit_rows, dtype=torch.long)
        else:
            rows = torch.arange(len(flat)) if all_logits else last_rows
        plan, (ids_dev, positions_dev, rows_dev) = prepare_plan(
            plan, self.cfg, inputs, flat, self.engine.page_size, self.device,
            [torch.tensor(flat), torch.tensor(positions), rows])
        logits = self.model.forward(ids_dev, positions_dev, plan, rows_dev)
        for seq, ids, ring in zip(seqs, token_ids, plan.next_rings):
            seq.num_cached += len(ids)
            seq.ring = ring
        return logits

    def _reserve_pages(self, seq: SeqState, num_positions: int) -> None:
        if num_positions > self.engine.max_model_len:
            raise ValueError(
                f"sequence of {num_positions} tokens exceeds the context of "
                f"{self.engine.max_model_len}"
            )
        needed = -(-num_positions // self.engine.page_size) - len(seq.page_ids)
        if needed > 0:
            seq.page_ids += self.pages.allocate(needed)


__all__ = ["Runner", "SeqState", "OutOfPages"]
