"""Draft-model speculation (`--speculative draft`): drafts drawn from a small model that shares
the target's vocabulary (Gemma 3 270M for the larger Gemma 3 models), run in the engine's
process by a runner of its own (muser/startup/draft.py builds it).

That runner holds the draft's weights and its own KV: pages for its full-attention layers,
rings for its sliding ones (window + K rows, as the target's), one slot per drafting sequence,
no prefix cache. A sequence that drafts holds a DraftKV there (seq.draft), freed with it.

propose(seq, k), each step the sequence drafts:
 1. In step. The draft holds rows for the sequence's context and for the drafts it proposed
    last step but the last (each drawn token is fed back to draw the next). The verify pass
    since then accepted a prefix of those drafts: the rows after it are dropped as the
    target's rejected rows are (Runner.truncate: pages past them given back, the ring back to
    its state before them, which loses no row still in a window). A context shift since then
    (muser/engine/shift.py) -> the draft's rows are dropped and computed again.
 2. Catch up. The ids the draft lacks (the token the verify pass chose after the accepted
    drafts, the last draft when all held, the whole context the first time) in one prefill
    -> the draft's logits for the sequence's next token.
 3. Draft k tokens, a one-row draft forward per token after the first. Draft i is drawn by
    the engine's sampler from the draft's logits with the sampler row the verify pass uses for
    the target's row i (muser/engine/sampling.py: the request's seed, the draw number of that
    output, penalties counting the drafts before it as outputs).

Why the target's draw. The verify pass accepts a draft where it equals the token the target
chooses at that row with plain decoding's noise (muser/engine/speculation.py), so the outputs
are plain decoding's whatever the drafts are; q, the draft's distribution, decides only how
often drafts hold. Drawn with the same Gumbel noise (muser/sampler.py: u is a function of seed,
draw number and token id), draft i is a true draw from q, and it equals the target's draw from
p unless the noise's argmax differs under the two: they agree with probability at least
(1 - TV(p, q)) / (1 + TV(p, q)) (Gumbel coupling; Daliri, Musco and Suresh, "Coupling without
communication and drafter-invariant speculative decoding", 2024), against 1 - TV(p, q) for
Leviathan et al.'s test min(1, p/q) with residual max(0, p - q) on an independent draw; that
test keeps the target's distribution but not plain decoding's tokens for a seed. Greedy rows
are each model's argmax; a draft equal to the target accepts every draft, greedy or sampled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from muser.engine.sampling import sampling_rows
from muser.kvcache.placement import Placement
from muser.kvcache.ring import RingState
from muser.runner import Runner
from muser.sampler import BatchSampler
from muser.sequence import Sequence


@dataclass(slots=True, eq=False, kw_only=True)
class DraftKV(Placement):
    """A sequence's rows in the draft's runner: their ids, and the ring's state before each
    row fed from the last draft on (what truncating to that row restores)."""

    ids: list[int] = field(default_factory=list)  # the ids of rows [0, num_cached)
    rings: dict[int, RingState] = field(default_factory=dict)  # num_cached -> ring then
    num_shifted: int = 0  # the sequence's context shifts these rows saw


class DraftModel:
    """The Proposer of `--speculative draft` (muser/engine/proposer.py)."""

    def __init__(self, runner: Runner, sampler: BatchSampler) -> None:
        self.runner, self.sampler = runner, sampler

    def propose(self, seq: Sequence, k: int) -> list[int]:
        logits = self.catch_up(seq)
        kv, drafts = seq.draft, []
        while True:
            drafts.append(self._draw(seq, drafts, logits))
            if len(drafts) == k:
                return drafts
            kv.rings[kv.num_cached] = kv.ring
            logits = self.runner.forward([kv], [drafts[-1:]])
            kv.ids.append(drafts[-1])

    def catch_up(self, seq: Sequence) -> torch.Tensor:
        """The draft's rows made `seq`'s context (steps 1 and 2) -> its logits after the
        context's last id [1, vocab]."""
        kv, ids = self._in_step(seq), seq.context_ids
        # NOTE: every decode-ready sequence steps or is preempted (forget) between proposals,
        # so its context has grown past the rows the draft holds
        assert kv.num_cached < len(ids), "the draft's rows reach the context's last id"
        logits = self.runner.prefill(kv, ids[kv.num_cached:])
        kv.ids += ids[len(kv.ids):]
        return logits

    def forget(self, seq: Sequence) -> None:
        """`seq` leaves (finished, cancelled, preempted): its draft rows and slot go."""
        if seq.draft is not None:
            self.runner.free(seq.draft)
            seq.draft = None

    def _in_step(self, seq: Sequence) -> DraftKV:
        """`seq`'s DraftKV holding only rows of its context, at least one fewer than it."""
        kv = seq.draft
        if kv is not None and kv.num_shifted != seq.num_shifted:
            self.forget(seq)
            kv = None
        if kv is None:
            kv = seq.draft = self.runner.allocate(seq=DraftKV(num_shifted=seq.num_shifted))
            return kv
        ids = seq.context_ids
        # NOTE: rows before the first fed draft are context; a fed draft holds while it is
        # the context's id there (the verify pass accepted it)
        held = min(kv.rings, default=kv.num_cached)
        while held < kv.num_cached and held < len(ids) - 1 and kv.ids[held] == ids[held]:
            held += 1
        if held < kv.num_cached:
            self.runner.truncate(kv, held, kv.rings[held])
            del kv.ids[held:]
        kv.rings = {}
        return kv

    def _draw(self, seq: Sequence, drafts: list[int], logits: torch.Tensor) -> int:
        """The token after `drafts` from the draft's `logits` [1, vocab], with the sampler row
        the verify pass samples the target's token there with (its logprobs not asked)."""
        row = sampling_rows(seq, drafts)[-1]
        if row.params.logprobs is not None:
            row.params = dataclasses.replace(row.params, logprobs=None)
        return self.sampler(logits, [row])[0]
