"""Speculation: which decode rows carry drafts this step, how many, and how many hold.

    draft(seqs) ..... before the step is scheduled: each sequence about to decode gets at most
                      its draft length of proposals (seq.drafts), within its request's limit
                      (SamplingParams.speculative), its max_tokens, the context, and the step's
                      budget of draft rows; a sequence with a grammar gets none (its mask for a
                      draft's row would need the grammar advanced by the drafts before it)
    accepted(...) ... after sampling: how many drafts the target's own choices confirm
    verified(...) ... the sequence's draft length adapts to what held (Drafting)
    forget(seq) ..... the sequence leaves the batch: the proposer frees what it holds for it

Exactness. Row i of a verify pass (the decode row, then drafts) is sampled exactly as plain
decoding samples that position: the same logits (on the CPU bitwise the same at any width,
docs/exactness.md), the same draw number (the output index), the same penalty history (the
drafts before it, which are the outputs plain decoding had, if they were accepted). Draft i+1
is accepted when row i's token equals it, so every token emitted is the token plain decoding
emits there, greedy or sampled with a seed: speculation changes when tokens come, never which.
A draft model's drafts are drawn with the same noise from its own distribution q
(muser/engine/draft_model.py), so they hold where q's draw agrees with p's. For a draft with
no distribution of its own (prompt lookup proposes one token), this is
rejection sampling (Leviathan et al.) with a point-mass draft: the draft is accepted with
probability p(draft), and a rejected row's token is drawn from p given that it is not the
draft, the normalized residual max(0, p - q).

Adaptive length, per sequence: all drafts accepted -> the next draft may be twice as long (up
to k); some rejected -> one longer than the accepted run; none accepted -> one token, and
the sequence drafts nothing for 1, 3, 7, 15, then 31 steps while misses repeat (a miss costs a
row of the verify pass; a hit resets it).
"""

from __future__ import annotations

from dataclasses import dataclass

from muser.core import SpecStats
from muser.engine.proposer import Proposer
from muser.sequence import Sequence

# NOTE: on the CPU a decode step of the 270M costs about as much as 6 more rows beside it
# (bench/results/spec_cpu.json, verify_ms); past this many rows in a step (decode rows and
# drafts) a rejected draft costs more than the steps its accepted ones save
STEP_ROWS = 16
MAX_BACKOFF = 31


@dataclass(slots=True)
class Drafting:
    """One sequence's draft length and its run of misses."""

    k: int
    misses: int = 0
    skip: int = 0  # steps left without drafts


class Speculation:
    def __init__(self, proposer: Proposer, k: int, max_model_len: int) -> None:
        self.proposer, self.k, self.max_model_len = proposer, k, max_model_len
        self.stats = SpecStats(k, by_position=[0] * k)

    def draft(self, seqs: list[Sequence], ahead: set[int] = frozenset()) -> None:
        """Set seq.drafts for the sequences about to decode (this step's proposals); those
        whose decode row was computed ahead (uids in `ahead`, muser/engine/ahead.py) get
        none."""
        room = STEP_ROWS - len(seqs)
        for seq in seqs:
            seq.drafts = []
            limit = self._limit(seq)
            if room <= 0 or limit <= 0 or seq.uid in ahead:
                continue
            d = seq.drafting
            if d is None:
                d = seq.drafting = Drafting(self.k)
            if d.skip:
                d.skip -= 1
                continue
            drafts = self.proposer.propose(seq, min(d.k, limit, room))
            seq.drafts = drafts if len(drafts) >= seq.sampling.min_drafts else []
            room -= len(seq.drafts)

    def may_draft(self, seqs: list[Sequence]) -> bool:
        """Whether the next step may give any of `seqs` (this step's decoding sequences)
        drafts: if so, its decode rows wait for this step's tokens (no decode ahead)."""
        return STEP_ROWS > len(seqs) and any(
            self._limit(seq) > 0 and (seq.drafting is None or seq.drafting.skip == 0)
            for seq in seqs)

    def _limit(self, seq: Sequence) -> int:
        """The most drafts `seq` may carry now."""
        p = seq.sampling
        if seq.constraint is not None or p.speculative == 0:
            return 0
        k = self.k if p.speculative is None else min(self.k, p.speculative)
        # NOTE: the verify pass's last row is sampled too: no draft past max_tokens or context
        return min(k, p.max_tokens - len(seq.output_ids) - 1,
                   self.max_model_len - seq.num_cached - 2)

    def forget(self, seq: Sequence) -> None:
        """`seq` finished, was cancelled or was preempted (Proposer.forget)."""
        self.proposer.forget(seq)

    def verified(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """`seq`'s verify pass accepted num_accepted of its num_drafts drafts."""
        s, d = self.stats, seq.drafting
        s.verified, s.drafted, s.accepted = s.verified + 1, s.drafted + num_drafts, (
            s.accepted + num_accepted)
        for i in range(num_accepted):
            s.by_position[i] += 1
        seq.num_drafted += num_drafts
        seq.num_accepted += num_accepted
        if num_accepted == num_drafts:
            d.k, d.misses = min(self.k, 2 * d.k), 0
        elif num_accepted:
            d.k, d.misses = num_accepted + 1, 0
        else:
            d.k, d.misses = 1, d.misses + 1
            d.skip = min(MAX_BACKOFF, 2 ** d.misses - 1)


def accepted(drafts: list[int], tokens: list[int]) -> int:
    """How many leading drafts equal the tokens chosen at the rows before them (tokens[i]:
    the choice after the decode row and drafts[:i])."""
    n = 0
    while n < len(drafts) and tokens[n] == drafts[n]:
        n += 1
    return n
