"""Output allocation for the launchers. MUSER_POISON_OUTPUTS=1 fills every output with NaN
first (tests), so an element a kernel fails to write cannot pass as a plausible value."""

from __future__ import annotations

import os

import torch

POISON = os.environ.get("MUSER_POISON_OUTPUTS") == "1"


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if POISON and dtype.is_floating_point else out
