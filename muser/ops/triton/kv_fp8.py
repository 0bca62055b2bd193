"""The FP8 KV cache's rows in the kernels (the format: muser/ops/kv_fp8.py): a KV head's row
of D + 4 bytes, its e4m3 codes then its scale's biased exponent.

Codes are stored and loaded as uint8 and reinterpreted as float8e4nv in registers: decoding
is exact (a code times a power of two), and encoding rounds with `round_e4m3`'s bit arithmetic
first, so the conversion after it rounds nothing (the interpreter's conversion truncates, the
GPU's rounds to nearest: both then give the same code). Readers dequantize in registers to the
dot dtype and run the same dot chain as a 16-bit cache: the exact route stays exact.

DOT names the dtype the attention dots run in (the cache's, or for FP8 the model's): a
constexpr int, as launch.py passes constexprs to the compiled launcher by value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.triton.quantize_fp8 import activation_scale, e4m3_codes

DOTS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dot_code(dtype: torch.dtype) -> int:
    """DOT's value for a dot dtype."""
    return DOTS[dtype]


@triton.jit
def to_dot(x, DOT: tl.constexpr):
    """x in the dot dtype DOT names."""
    if DOT == 1:
        return x.to(tl.bfloat16)
    elif DOT == 2:
        return x.to(tl.float16)
    else:
        return x.to(tl.float32)


@triton.jit
def load_heads(ptr, at, d, mask, D: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr):
    """Rows of one KV head each: `at` [N] int64 element offsets of the rows' starts, d
    tl.arange(0, D), mask [N] -> [N, D] in the dot dtype (0 where masked). FP8: codes times
    the row's scale, exactly."""
    if FP8:
        codes = tl.load(ptr + at[:, None] + d[None, :], mask=mask[:, None], other=0)
        e = tl.load(ptr + at + D, mask=mask, other=127).to(tl.int32)
        scale = (e << 23).to(tl.float32, bitcast=True)
        x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        return to_dot(x, DOT)
    else:
        return to_dot(tl.load(ptr + at[:, None] + d[None, :], mask=mask[:, None], other=0.0), DOT)


@triton.jit
def codes_of(x, inverse):
    """float32 x [N, W] times its rows' exact 1 / scale [N] -> e4m3 codes as uint8."""
    return e4m3_codes(x, inverse[:, None], tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def quantize_heads(x):
    """x: [N, D] float32, a KV head's row each -> (codes [N, D] uint8, scales [N] float32, the
    dequantized values [N, D] float32): kv_fp8.quantize_rows' bits."""
    scale, inverse = activation_scale(tl.max(tl.abs(x), axis=1))
    codes = codes_of(x, inverse)
    return codes, scale, codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]


@triton.jit
def store_tail(ptr, at, scale, mask, D: tl.constexpr):
    """The 4 bytes after the codes of packed rows at element offsets `at` [N]: the scale's
    biased exponent, then three zeros."""
    e = scale.to(tl.int32, bitcast=True) >> 23
    tail = tl.arange(0, 4)
    tl.store(ptr + at[:, None] + D + tail[None, :],
             tl.where(tail[None, :] == 0, e[:, None], 0).to(tl.uint8), mask=mask[:, None])


@triton.jit
def store_heads(ptr, at, d, codes, scale, mask, D: tl.constexpr):
    """Packed rows at element offsets `at` [N] (int64): codes [N, D] uint8, then the scale's
    exponent and three zero bytes."""
    tl.store(ptr + at[:, None] + d[None, :], codes, mask=mask[:, None])
    store_tail(ptr, at, scale, mask, D)
