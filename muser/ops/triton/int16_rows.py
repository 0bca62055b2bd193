"""Decode rows as 14-bit fixed point per group of 32 values, for the block GEMV's integer dot
products (gemv_blocks.py): x ~ s q with a power-of-two scale s per group and an int16 q, so a
block of codes times x is s times an exact int32 sum, two codes a dp2a instruction.

Per group of 32 values with largest magnitude a (biased exponent e_a, taken as at least 13):
    s = 2^(e_a - 127 - 12)  (a / s < 2^13),  q = rint(x / s),  |q| <= 2^13,
    x^ = s q,  |x - x^| <= s / 2 <= 2^-13 a
Dividing by s is exact (a power of two; where x / s underflows, q is 0 either way), so the
rounding to an integer is the only one: every value within 2^5 of its group's largest is kept
exactly when it has at most 8 significant bits (bfloat16).

Outputs per row: `q` (int16, read as int64 words of four), `scale` (s per group, float32),
and the x sums that blocks' offsets multiply, exact, as int32 sums of q: `sums` per group
(Q4_K's mins), `half_sums` per 16 values (Q6_K's -32 q), ordered per 256 values as the first
halves of their 8 groups, then the second halves (so a Q6_K program reads the sums of its
sub-blocks as consecutive words).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from muser.ops.triton.alloc import empty
from muser.ops.triton.launch import cdiv, launch
from muser.ops.triton.pdl import enter, options

GROUP = 32  # values per scale
GROUPS = 8  # groups per program


class Int16Rows(NamedTuple):
    """x: [N, K] as 14-bit fixed point (see the module docstring); K a multiple of 256."""

    q: torch.Tensor  # int16 [N, K]
    scale: torch.Tensor  # float32 [N, K / 32]: s
    sums: torch.Tensor  # int32 [N, K / 32]: sum of q per group
    half_sums: torch.Tensor  # int32 [N, K / 16]: per half group, in the order above


@triton.jit
def _int16_rows_kernel(x_ptr, q_ptr, scale_ptr, sums_ptr, half_ptr, K, stride_xn,
                       GROUPS: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(1)
    grp = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # [G]
    at = grp[:, None, None] * 32 + 16 * tl.arange(0, 2)[None, :, None] \
        + tl.arange(0, 16)[None, None, :]  # [G, 2, 16]: value 32 grp + 16 u + v
    gmask = grp < K // 32
    enter(PDL)
    x = tl.load(x_ptr + n * stride_xn + at, mask=gmask[:, None, None], other=0.0)
    x = x.to(tl.float32)
    a = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [G]
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 13) - 12  # s's biased exponent
    t = x * ((254 - e[:, None, None]) << 23).to(tl.float32, bitcast=True)  # x / s: exact
    # round half to even by the float 1.5 * 2^23 (|t| <= 2^13)
    q = (t + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
    tl.store(q_ptr + n * K + at, q.to(tl.int16), mask=gmask[:, None, None])
    tl.store(scale_ptr + n * (K // 32) + grp, (e << 23).to(tl.float32, bitcast=True),
             mask=gmask)
    halves = tl.sum(q, axis=2)  # [G, 2]
    tl.store(sums_ptr + n * (K // 32) + grp, tl.sum(halves, axis=1), mask=gmask)
    # half u of group grp = 8 c + r (block c of 256 values): 16 c + 8 u + r
    half = 16 * (grp[:, None] // 8) + 8 * tl.arange(0, 2)[None, :] + grp[:, None] % 8
    tl.store(half_ptr + n * (K // 16) + half, halves, mask=gmask[:, None])


def int16_rows(x: torch.Tensor) -> Int16Rows:
    """x: [N, K] float (K a multiple of 256, unit stride along K) -> its Int16Rows."""
    n, k = x.shape
    assert k % 256 == 0 and x.stride(-1) == 1 and x.dtype.is_floating_point
    dev = x.device
    rows = Int16Rows(empty((n, k), torch.int16, dev), empty((n, k // 32), torch.float32, dev),
                     empty((n, k // 32), torch.int32, dev), empty((n, k // 16), torch.int32, dev))
    launch(_int16_rows_kernel, (cdiv(k // GROUP, GROUPS), n), x, *rows, k, x.stride(0),
           GROUPS=GROUPS, num_warps=4, **options(dev))
    return rows
