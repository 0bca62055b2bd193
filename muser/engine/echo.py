"""Prompt logprobs (SamplingParams.prompt_logprobs): the logprob of every prompt token after the
first, from the logits of the prefill row before it.

A request that asks is prefilled without its cached prefix, at most ECHO_ROWS rows per step.
The plan picks the rows of each chunk whose logprob is due (`EchoRows.add`), the forward returns
their logits after the due rows', `record` turns them into each sequence's Logprobs, and the
request's first output carries them all once the prompt is done (`due_prompt_logprobs`). A fork's prompt
logprobs are its first sample's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from muser.core import Logprobs
from muser.logprobs import token_logprobs
from muser.sequence import Sequence

ECHO_ROWS = 64  # prefill rows per step of a request that wants prompt logprobs


@dataclass(slots=True)
class EchoRows:
    """The forward's rows whose logits give a prompt token's logprob, and which."""

    rows: list[int] = field(default_factory=list)  # flat rows of the step's forward
    token_ids: list[int] = field(default_factory=list)  # the prompt token each row predicts
    seqs: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, ids: list[int], flat: int) -> None:
        """`seq`'s chunk `ids` starts at flat row `flat` (before the step: at position
        seq.num_cached): its rows whose prompt logprob is due."""
        if seq.sampling.prompt_logprobs is None:
            return
        start = seq.num_cached
        for pos in range(max(start, seq.next_prompt_lp - 1),
                         min(start + len(ids), seq.num_prompt - 1)):
            self.rows.append(flat + pos - start)
            self.token_ids.append(seq.prompt_ids[pos + 1])
            self.seqs.append(seq)

    def record(self, logits: torch.Tensor) -> None:
        """logits [len(rows), vocab] of these rows -> each sequence's prompt logprobs."""
        k = max(seq.sampling.prompt_logprobs for seq in self.seqs)
        for seq, lp in zip(self.seqs, token_logprobs(logits, self.token_ids, k)):
            seq.prompt_lps.append(Logprobs(lp.logprob, lp.top[:seq.sampling.prompt_logprobs]))
            seq.next_prompt_lp += 1


def due_prompt_logprobs(seq: Sequence) -> tuple[Logprobs, ...] | None:
    """The prompt logprobs `seq`'s output carries now: all of them, once, in the first sample's
    first output after its prompt; None otherwise."""
    if seq.sampling.prompt_logprobs is None or seq.index != 0 or (
            seq.next_prompt_lp < seq.num_prompt):
        return None
    lps, seq.prompt_lps = tuple(seq.prompt_lps), []
    seq.next_prompt_lp = seq.num_prompt + 1  # NOTE: sent once
    return lps or None
