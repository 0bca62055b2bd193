"""Output allocation for the launchers. With the `poison` switch (switches.py: tests) every
output is filled with NaN first, so an element a kernel fails to write cannot pass as a
plausible value."""

from __future__ import annotations

import torch

from muser.ops.triton.switches import current as switches_in_force


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    poison = dtype.is_floating_point and switches_in_force().poison
    return out.fill_(float("nan")) if poison else out
