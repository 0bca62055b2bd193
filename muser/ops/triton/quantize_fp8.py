"""Activations -> FP8 per token (`muser.ops.fp8.quantize_activations`' codes and scales bit
for bit: a power-of-two scale per row from its largest |x|, then each value times the exact
1 / scale rounded to e4m3, nearest, ties to even), the input of the FP8 tensor-core prefill
route (muser/ops/triton/linear_fp8.py). A power of two makes the scaling exact: one multiply a
value, where a scale of exactly amax / 448 needs a correctly rounded division per value (a
reciprocal, a correction and a branch in the compiled code).

Two kernels over a grid of (row, block of BLOCK values), every block its own program: the
largest |x| of each block (`_block_amax_kernel`, or the kernel that wrote x: GeGLU emits its
blocks' maxima as it stores them), then each block's codes from the row's largest of those
(`_quantize_blocks_kernel`: a row's few partial maxima are read by each of its programs, so no
program waits for another). A program per row walking the row twice (the kernel before this
one) left a 512-row chunk's rows of 21,504 values at a quarter of copy bandwidth
(bench/fp8_check.py, "quantize"): each row's passes ran one after another on one SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.fp8 import FP8, FP8_MAX, Fp8Matrix
from muser.ops.triton.alloc import empty
from muser.ops.triton.launch import cdiv, launch, next_power_of_2


@triton.jit
def round_e4m3(v):
    """float32 v, |v| <= 448 -> the nearest e4m3 value (ties to even), still float32: exact
    in e4m3, so the conversion after it rounds nothing (whatever rounding it implements).
    Normal range: 3 mantissa bits kept by adding half an e4m3 ulp less one (plus the kept
    lowest bit: ties to even) and cutting; below 2^-6 (subnormals, spacing 2^-9): adding
    1.5 * 2^14 to |v|, whose float32 spacing is 2^-9, rounds to that grid by the hardware
    (the sign put back after, so -0 stays -0)."""
    b = v.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    tiny = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (b & -0x80000000)
    return tl.where(tl.abs(v) < 0.015625, tiny.to(tl.float32, bitcast=True), normal)


@triton.jit
def activation_scale(amax):
    """`fp8.activation_scales` of one row's largest |x| (float32, >= 0) -> (scale, 1 / scale),
    both powers of two, in integer arithmetic on the bits."""
    bits = amax.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32), 1)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_codes(x, inverse, codes_ty: tl.constexpr):
    """float32 values times their row's exact 1 / scale -> e4m3 codes (nearest, ties to even;
    within +-448 by the scale's choice, clamped all the same)."""
    return round_e4m3(tl.minimum(tl.maximum(x * inverse, -448.0), 448.0)).to(codes_ty)


@triton.jit
def _block_amax_kernel(x_ptr, amax_ptr, K, stride_xn, BLOCK: tl.constexpr):
    """amax[row, block] = max |x| over the block's values."""
    row, blk = tl.program_id(0), tl.program_id(1)
    kk = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xn + kk, mask=kk < K, other=0.0)
    tl.store(amax_ptr + row * tl.num_programs(1) + blk, tl.max(tl.abs(x.to(tl.float32)), axis=0))


@triton.jit
def _quantize_blocks_kernel(x_ptr, amax_ptr, data_ptr, scales_ptr, K, stride_xn,
                            BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """The codes of one block: the row's scale from its blocks' maxima (BLOCKS >= their
    count, a power of two), then x times 1 / scale rounded; the row's first block stores the
    scale."""
    row, blk, nblk = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    b = tl.arange(0, BLOCKS)
    amax = tl.max(tl.load(amax_ptr + row * nblk + b, mask=b < nblk, other=0.0), axis=0)
    scale, inverse = activation_scale(amax)
    if blk == 0:
        tl.store(scales_ptr + row, scale)
    kk = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xn + kk, mask=kk < K, other=0.0)
    tl.store(data_ptr + row.to(tl.int64) * K + kk,
             e4m3_codes(x.to(tl.float32), inverse, data_ptr.dtype.element_ty), mask=kk < K)


BLOCK = 1024  # values a program (both kernels; GeGLU's blocks too)


def launch_rule(k: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of k values."""
    return min(next_power_of_2(k), BLOCK), 4


def quantize_rows_fp8(x: torch.Tensor, rule=launch_rule,
                      block_amax: torch.Tensor | None = None) -> Fp8Matrix:
    """x: [N, K] float, rows unit-stride -> Fp8Matrix of its rows (a scale per row), equal to
    quantize_activations(x); rule: k -> (BLOCK, num_warps) (benchmarks compare others); block_amax:
    float32 [N, cdiv(K, BLOCK)] the largest |x| of each block of rule(K)'s BLOCK values,
    given by the kernel that wrote x (else measured here)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and FP8_MAX == 448.0
    n, k = x.shape
    block, warps = rule(k)
    blocks = cdiv(k, block)
    data = empty((n, k), FP8, x.device)
    scales = empty((n,), torch.float32, x.device)
    if block_amax is None:
        block_amax = empty((n, blocks), torch.float32, x.device)
        launch(_block_amax_kernel, (n, blocks), x, block_amax, k, x.stride(0), BLOCK=block,
               num_warps=warps)
    assert block_amax.shape == (n, blocks) and block_amax.is_contiguous()
    launch(_quantize_blocks_kernel, (n, blocks), x, block_amax, data, scales, k, x.stride(0),
           BLOCK=block, BLOCKS=next_power_of_2(blocks), num_warps=warps)
    return Fp8Matrix(data, scales, x.dtype)
