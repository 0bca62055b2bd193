"""A step's due sequences -> their sampler rows and grammar masks, sampled on the device."""

from __future__ import annotations

import torch

from muser.grammar import GrammarMasks
from muser.sampler import BatchSampler, Pending, SamplingRow
from muser.sequence import Sequence


def launch_sample(sampler: BatchSampler, grammars: GrammarMasks, logits: torch.Tensor,
                  seqs: list[Sequence]) -> Pending:
    """One token (and its logprobs, where asked) per row of logits [len(seqs), vocab], left on
    their way to the host. NOTE: called after the forward pass is launched: on a GPU the
    constrained rows' masks are computed on the host while it runs."""
    bitmask = grammars.masks([seq.constraint for seq in seqs])
    return sampler.launch(logits, [sampling_row(seq) for seq in seqs], bitmask)


def sampling_row(seq: Sequence) -> SamplingRow:
    """What the sampler needs of `seq`: parameters, seed, draw number, penalty histories."""
    p = seq.sampling
    history = seq.all_ids if p.repeat_penalty != 1.0 and p.repeat_last_n else []
    outputs = []
    if p.presence_penalty or p.frequency_penalty:
        outputs = seq.output_ids if not p.penalties_over_last_n else (
            seq.all_ids[-p.repeat_last_n:] if p.repeat_last_n else [])
    return SamplingRow(p, seq.seed, len(seq.output_ids), history, outputs)
