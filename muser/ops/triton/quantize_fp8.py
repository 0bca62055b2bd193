"""Activations -> FP8 per token in one kernel: each row of x [N, K] scaled so its largest |x|
lands on 448 and rounded to e4m3 (`muser.ops.fp8.quantize_fp8`'s values bit for bit: the
same float32 amax / 448, the same correctly rounded division, the same saturating
round-to-nearest-even), the input of the FP8 tensor-core prefill route
(muser/ops/triton/linear_fp8.py). One program per row, four warps: a row of up to BLOCK_K
values is read once into registers, a longer one twice, BLOCK_K at a time (its largest |x|,
then the codes; the second read hits L1 or L2). Small programs keep many rows in flight on
each SM; a whole row in registers (up to 32,768 values, 16 warps) left one row per SM at a time
and ran a 2,048-row prefill's quantizations at 69 us a call (bench/fp8_check.py, "quantize").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.fp8 import FP8, FP8_MAX, SCALE_MIN, Fp8Matrix
from muser.ops.triton.alloc import empty
from muser.ops.triton.launch import launch, next_power_of_2


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
def _quantize_fp8_kernel(x_ptr, data_ptr, scales_ptr, K, stride_xn, tiny,
                         BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xn
    out_row = data_ptr + row.to(tl.int64) * K
    if K <= BLOCK_K:  # the whole row in registers: one read
        kk = tl.arange(0, BLOCK_K)
        x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0), tiny)
        tl.store(scales_ptr + row, scale)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(out_row + kk, round_e4m3(q).to(data_ptr.dtype.element_ty), mask=kk < K)
    else:
        amax = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + kk, mask=kk < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), tiny)
        tl.store(scales_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + kk, mask=kk < K, other=0.0)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -448.0), 448.0)
            tl.store(out_row + kk, round_e4m3(q).to(data_ptr.dtype.element_ty), mask=kk < K)


def launch_rule(k: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps) for rows of k values."""
    return min(next_power_of_2(k), 2048), 4


def quantize_rows_fp8(x: torch.Tensor, rule=launch_rule) -> Fp8Matrix:
    """x: [N, K] float, rows unit-stride -> Fp8Matrix of its rows (a scale per row), equal to
    quantize_fp8(x); rule: k -> (BLOCK_K, num_warps) (benchmarks compare others)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and FP8_MAX == 448.0
    n, k = x.shape
    data = empty((n, k), FP8, x.device)
    scales = empty((n,), torch.float32, x.device)
    block, warps = rule(k)
    launch(_quantize_fp8_kernel, (n,), x, data, scales, k, x.stride(0), SCALE_MIN,
           BLOCK_K=block, num_warps=warps)
    return Fp8Matrix(data, scales, x.dtype)
