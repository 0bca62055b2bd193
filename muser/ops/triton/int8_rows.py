"""Decode rows as two levels of int8 per group of 32 values, for the block GEMV's integer dot
products (gemv_blocks.py): x ~ s (128 h + l) with a power-of-two scale s per group and
h, l in [-64, 64], so a block of codes q times x is s * (128 sum q h + sum q l), two dp4a
instructions per four codes per level, summed exactly in int32.

Per group of 32 values with largest magnitude a (biased exponent e_a, taken as at least 13):
    S = 2^(e_a - 127 - 5)  (a / S < 64),  t = x / S,  h = rint(t),  l = rint(128 (t - h)),
    s = S / 128,  x^ = s (128 h + l),  |h|, |l| <= 64,  |x - x^| <= s / 2
Every step is exact but the roundings to integers: products by powers of two (t never
underflows where it matters: |t| < 2^-126 gives h = l = 0), and t - h (|t - h| <= 1 / 2).
So every value within 2^5 of the group's largest is kept exactly when it has at most 8
significant bits (bfloat16), and the error of any other is at most 2^-13 of that largest.

Outputs per row: `hi`, `lo` (int8 h and l, value k at byte k, read as int32 words), `scale`
(s per group, float32), and the x sums that blocks' offsets multiply, exact, as int32 sums of
128 h + l: `sums` per group (Q4_K's mins), `half_sums` per 16 values (Q6_K's -32 q), ordered
per 256 values as the first halves of their 8 groups, then the second halves (so a Q6_K
program reads the sums of its sub-blocks as consecutive words; a last partial 256 of a row,
which only Q8_0's rows have, as if zeros followed it).
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
GROUPS = 8  # groups per program: a program's half sums are those of one 256


class Int8Rows(NamedTuple):
    """x: [N, K] as two int8 levels (see the module docstring); K a multiple of 32."""

    hi: torch.Tensor  # int32 [N, K / 4]: four h bytes a word
    lo: torch.Tensor  # int32 [N, K / 4]: four l bytes a word
    scale: torch.Tensor  # float32 [N, K / 32]: s
    sums: torch.Tensor  # int32 [N, K / 32]: sum of 128 h + l per group
    half_sums: torch.Tensor  # int32 [N, 16 ceil(K / 256)]: per half group, in the order above


@triton.jit
def _rint(v):
    """round-half-even of |v| < 2^22 -> int32, by the float 1.5 * 2^23."""
    return (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _pack(q):
    """[..., 4] int32 in [-128, 127] -> [...] words of their bytes (byte k: element k)."""
    k = tl.arange(0, 4)[None, None, None, :]
    return tl.sum((q & 0xFF) << (8 * k), axis=3)


@triton.jit
def _int8_rows_kernel(x_ptr, hi_ptr, lo_ptr, scale_ptr, sums_ptr, half_ptr, K, stride_xn,
                      GROUPS: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(1)
    grp = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # [G]
    # value 32 grp + 16 u + 4 i + k: u, the 16-value half (its sum), i, the word, k, the byte
    u = tl.arange(0, 2)[None, :, None, None]
    i = tl.arange(0, 4)[None, None, :, None]
    k = tl.arange(0, 4)[None, None, None, :]
    at = grp[:, None, None, None] * 32 + 16 * u + 4 * i + k  # [G, 2, 4, 4]
    mask = at < K
    enter(PDL)
    x = tl.load(x_ptr + n * stride_xn + at, mask=mask, other=0.0).to(tl.float32)
    a = tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=1)  # [G]
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 13) - 5  # S's biased exponent
    e4 = e[:, None, None, None]
    t = x * ((254 - e4) << 23).to(tl.float32, bitcast=True)  # x / S
    h = _rint(t)
    low = _rint((t - h.to(tl.float32)) * 128.0)
    gmask = grp < K // 32
    word = n * (K // 4) + grp[:, None, None] * 8 + 4 * tl.arange(0, 2)[None, :, None] \
        + tl.arange(0, 4)[None, None, :]
    tl.store(hi_ptr + word, _pack(h), mask=gmask[:, None, None])
    tl.store(lo_ptr + word, _pack(low), mask=gmask[:, None, None])
    tl.store(scale_ptr + n * (K // 32) + grp, ((e - 7) << 23).to(tl.float32, bitcast=True),
             mask=gmask)
    halves = tl.sum(tl.sum(128 * h + low, axis=3), axis=2)  # [G, 2]
    tl.store(sums_ptr + n * (K // 32) + grp, tl.sum(halves, axis=1), mask=gmask)
    # half u of group grp = 8 c + r (block c of 256 values): 16 c + 8 u + r. NOTE: unmasked:
    # the programs cover whole 256s (GROUPS = 8), the groups past K are zeros
    half = 16 * (grp[:, None] // 8) + 8 * tl.arange(0, 2)[None, :] + grp[:, None] % 8
    tl.store(half_ptr + n * (16 * tl.cdiv(K, 256)) + half, halves)


def int8_rows(x: torch.Tensor) -> Int8Rows:
    """x: [N, K] float (K a multiple of 32, unit stride along K) -> its Int8Rows."""
    n, k = x.shape
    assert k % GROUP == 0 and x.stride(-1) == 1 and x.dtype.is_floating_point
    dev = x.device
    rows = Int8Rows(empty((n, k // 4), torch.int32, dev), empty((n, k // 4), torch.int32, dev),
                    empty((n, k // 32), torch.float32, dev), empty((n, k // 32), torch.int32, dev),
                    empty((n, 16 * cdiv(k, 256)), torch.int32, dev))
    launch(_int8_rows_kernel, (cdiv(k // GROUP, GROUPS), n), x, *rows, k, x.stride(0),
           GROUPS=GROUPS, num_warps=4, **options(dev))
    return rows
