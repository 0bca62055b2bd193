"""RoPE angles: cos and sin of positions * inv_freq in one launch (ref.rope_cos_sin's torch
arithmetic takes about seven small kernels per call). inv_freq is computed once per (device,
head_dim, theta, scaling) with the reference's own arithmetic, on the device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from muser.ops import ref
from muser.ops.triton.alloc import empty
from muser.ops.triton.launch import cdiv, launch, next_power_of_2
from muser.ops.triton.pdl import enter, options

_INV_FREQ: dict[tuple, torch.Tensor] = {}


# NOTE: the row count and the positions' offset in the step's metadata vary from one forward to the
# next; left unspecialized, they need no compile the warm-up did not do (muser/startup/warmup.py)
@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["pos_ptr"])
def _rope_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, N, HALF: tl.constexpr,
                 BLOCK_N: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + rn, mask=rn < N, other=0).to(tl.float32)
    angles = pos[:, None] * tl.load(inv_ptr + d)[None, :]
    at = rn[:, None] * HALF + d[None, :]
    mask = rn[:, None] < N
    if LIBDEVICE:  # CUDA's precise cosf/sinf (as torch's), whatever tl.cos lowers to
        tl.store(cos_ptr + at, libdevice.cos(angles), mask=mask)
        tl.store(sin_ptr + at, libdevice.sin(angles), mask=mask)
    else:  # the interpreter (numpy)
        tl.store(cos_ptr + at, tl.cos(angles), mask=mask)
        tl.store(sin_ptr + at, tl.sin(angles), mask=mask)


def inv_freq(head_dim: int, theta: float, scaling: float, device: torch.device,
             fraction: float = 1.0) -> torch.Tensor:
    key = (torch.device(device), head_dim, theta, scaling, fraction)
    if key not in _INV_FREQ:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("RoPE frequencies first needed during graph capture: warm up first")
        _INV_FREQ[key] = ref.inv_freq(head_dim, theta, scaling, fraction, device).contiguous()
    return _INV_FREQ[key]


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: float = 1.0,
    fraction: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [N] int -> (cos, sin): [N, head_dim // 2] float32 (ref.rope_cos_sin)."""
    n, half = positions.shape[0], head_dim // 2
    assert positions.stride(0) == 1 and half == next_power_of_2(half)
    cos = empty((n, half), torch.float32, positions.device)
    sin = empty((n, half), torch.float32, positions.device)
    block = 16
    launch(
        _rope_kernel, (cdiv(n, block),), positions,
        inv_freq(head_dim, theta, scaling, positions.device, fraction), cos, sin, n, HALF=half,
        BLOCK_N=block, LIBDEVICE=positions.is_cuda, **options(positions.device))
    return cos, sin
