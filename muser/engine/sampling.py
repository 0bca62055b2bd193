"""A step's due sequences -> their sampler rows and grammar masks, sampled on the device."""

from __future__ import annotations

import torch

from muser.grammar import GrammarMasks
from muser.sampler import BatchSampler, Pending, SamplingRow
from muser.sequence import Sequence


def launch_sample(sampler: BatchSampler, grammars: GrammarMasks, logits: torch.Tensor,
                  seqs: list[Sequence]) -> Pending:
    """One token (and its logprobs, where asked) per row of logits, left on their way to the
    host: a row per sequence, and one more per draft of a sequence verifying drafts
    (sampling_rows). NOTE: called after the forward pass is launched: on a GPU the
    constrained rows' masks are computed on the host while it runs."""
    rows = [row for seq in seqs for row in sampling_rows(seq)]
    bitmask = grammars.masks([seq.constraint for seq in seqs for _ in range(1 + len(seq.drafts))])
    return sampler.launch(logits, rows, bitmask)


def sampling_rows(seq: Sequence, drafts: list[int] | None = None) -> list[SamplingRow]:
    """What the sampler needs of `seq` (parameters, seed, draw number, penalty histories) for
    its next token, and for the token after each of its drafts (`drafts`, default seq.drafts)
    as if the drafts before it were its outputs (muser/engine/speculation.py: plain decoding's
    rows, if they are accepted; muser/engine/draft_model.py draws its drafts with them)."""
    p = seq.sampling
    drafts = seq.drafts if drafts is None else drafts
    history = seq.all_ids if p.repeat_penalty != 1.0 and p.repeat_last_n else []
    outputs = []
    if p.presence_penalty or p.frequency_penalty:
        outputs = seq.output_ids if not p.penalties_over_last_n else (
            seq.all_ids[-p.repeat_last_n:] if p.repeat_last_n else [])
    rows = [SamplingRow(p, seq.seed, len(seq.output_ids), history, outputs)]
    for i in range(1, 1 + len(drafts)):
        drafted = drafts[:i]
        h = history and history + drafted
        o = outputs and (outputs + drafted if not p.penalties_over_last_n else (
            (seq.all_ids + drafted)[-p.repeat_last_n:]))
        rows.append(SamplingRow(p, seq.seed, len(seq.output_ids) + i, h, o))
    return rows
