"""Token sampling: repetition penalty, top-k, top-p, min-p, temperature, seeded draws."""

from __future__ import annotations

import torch

from muser.core import SamplingParams


class Sampler:
    """Samples one token per sequence; seeded requests draw from their own generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else
                                   torch.seed() & 0x7FFF_FFFF)

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """logits: [vocab] float32 -> token id."""
        p = self.params
        logits = logits.float().cpu()
        if p.repeat_penalty != 1.0 and p.repeat_last_n and history:
            logits = apply_repeat_penalty(logits, history[-p.repeat_last_n:], p.repeat_penalty)
        if p.is_greedy:
            return int(torch.argmax(logits))
        return self._draw(filter_logits(logits, p.top_k, p.top_p, p.min_p), p.temperature)

    def _draw(self, candidates: tuple[torch.Tensor, torch.Tensor], temperature: float) -> int:
        ids, values = candidates
        probs = torch.softmax(values / temperature, dim=-1)
        return int(ids[torch.multinomial(probs, 1, generator=self.generator)])


def apply_repeat_penalty(logits: torch.Tensor, recent: list[int], penalty: float) -> torch.Tensor:
    """llama.cpp's rule: divide positive logits of recent tokens by `penalty`, multiply others."""
    logits = logits.clone()
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
    seen = logits[ids]
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def filter_logits(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (candidate ids, their logits) sorted by logit, after top-k, top-p and min-p."""
    k = top_k if 0 < top_k < logits.numel() else logits.numel()
    values, ids = torch.topk(logits, k)
    if top_p < 1.0:
        cumulative = torch.softmax(values, dim=-1).cumsum(-1)
        keep = int(torch.searchsorted(cumulative, torch.tensor([top_p]))) + 1
        values, ids = values[:keep], ids[:keep]
    if min_p > 0.0:
        probs = torch.softmax(values, dim=-1)
        keep = probs >= min_p * probs[0]
        values, ids = values[keep], ids[keep]
    return ids, values
