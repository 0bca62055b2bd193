"""Decode GEMV over FP8 weights: y[N, M] = (x[N, K] @ data[M, K]^T) * scales[M] for a few rows
(N <= 8), the e4m3 codes streamed once (one byte per weight, half a bfloat16 GEMV's bytes).

The bfloat16 GEMV's structure (muser/ops/triton/gemv.py): BLOCK_M rows per program, optionally
SPLIT_K programs per row block, accumulated in float32, then each row's scale multiplies its
sum (or each split's partial) once and `gemv.finish` rounds y to x's dtype (the model's: the
caller hands x in it) and runs the same epilogues: plain, GeGLU, residual add + RMSNorm.

Four main loops (GemvConfig.kind), the fastest picked per shape by timing (linear_fp8.py):
- "fma": codes widened to float32 in registers, products accumulated there, reduced once
  (x's rows broadcast over a [rows, BLOCK_M, BLOCK_K] accumulator: the compiled loop moves
  each weight tile through shared memory to that layout, 16 bits at a time);
- "row", one row of x only: the same arithmetic on a [BLOCK_M, BLOCK_K] accumulator in the
  weight tile's own layout (16 codes a thread per load, widened in registers: one packed
  convert per two codes, no layout conversion of the weights); num_stages 1 loads each tile
  into registers when the loop reaches it, more stages load tiles ahead into shared memory by
  cp.async (Triton's pipeliner, asked for by `tl.range`: it does not pipeline loads that feed
  no dot on its own). The first two tiles (AHEAD) are loaded before the programmatic-launch
  wait (pdl.py): weights are no earlier kernel's output, so the loads run while the kernel
  before finishes; two, not more, because each tile held across the wait costs registers a
  thread (docs/gpu-notes.md has the measurements);
- "dot": tensor cores in float16. Every e4m3 value is a float16 value, widened by one packed
  convert per two codes. x enters float16 multiplied by a power of two per row
  (`_pow2_scales`: the row's largest |x| in [2^14, 2^15), exact), divided out of the float32 sums
  after. With 2^e <= max |x| < 2^(e+1) for the row, a bfloat16 x is then exact in float16 (8
  significant bits in 11) except entries below 2^(e-28), which land among float16's
  subnormals (absolute error <= 2^(e-39)); a float32 x also rounds to 11 bits (2^-11
  relative), below the weights' e4m3 rounding (2^-4);
- "dot8": FP8 tensor cores on the codes as stored (no widening at all), x quantized to e4m3
  per row over the program's K range: times the power of two that puts its largest |x| in
  [2^7, 2^8) (exact), rounded to nearest e4m3 (ties to even), the sums divided by it after.
  Each x entry is then within 2^-4 of itself, or among e4m3's subnormals (below 2^-13 of the
  row's largest) within 2^-10 / up: x_hat = e4m3(x * up) / up, the only rounding before the
  float32 sum (`x_hat_dot8` in the tests computes it).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from muser.ops.fp8 import Fp8Matrix
from muser.ops.triton.gemv import (
    MAX_ROWS,
    GemvConfig,
    NormEpilogue,
    candidates,
    finish,
    outputs,
    weight_rows,
    weight_tile,
    x_tile,
)
from muser.ops.triton.launch import cdiv, launch, next_power_of_2
from muser.ops.triton.pdl import enter, options
from muser.ops.triton.quantize_fp8 import round_e4m3

DEFAULT = GemvConfig("fma", 4, 64, 1, 4)
AHEAD = 2  # the row loop's weight tiles loaded before the programmatic-launch wait (1 or 2)


@triton.jit
def _tiles(x_ptr, w_ptr, rows, valid, rn, kk, k_hi, N, K, stride_xn):
    """gemv.tiles with x's load issued first, the order these loops were measured in."""
    x = x_tile(x_ptr, rn, kk, k_hi, N, stride_xn)
    return weight_tile(w_ptr, rows, valid, kk, k_hi, K), x


@triton.jit
def _row_fma(acc2, w, x_ptr, kk, k_hi):
    """The row loop's step: one weight tile [BLOCK_M, BLOCK_K] times x's columns kk, added to
    the accumulator in the tile's own layout."""
    x = tl.load(x_ptr + kk, mask=kk < k_hi, other=0.0)
    return acc2 + w.to(tl.float32) * x.to(tl.float32)[None, :]


FMA, DOT16, DOT8, ROW = (tl.constexpr(0), tl.constexpr(1), tl.constexpr(2),
                         tl.constexpr(3))  # the main loops
LOOPS = {"fma": 0, "dot": 1, "dot8": 2, "row": 3}  # GemvConfig.kind -> LOOP


@triton.jit
def _row_amax(x_ptr, rn, k_lo, k_hi, N, stride_xn, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """max |x| per row over columns k_lo .. k_hi - 1, float32 [BLOCK_N] (0 for padding rows)."""
    amax = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = x_tile(x_ptr, rn, kk, k_hi, N, stride_xn)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return amax


@triton.jit
def _pow2_scales(amax, TOP: tl.constexpr):
    """Powers of two (up, down = 1 / up) per row that put its largest |x| in [2^TOP,
    2^(TOP+1)): x * up is exact in float32. amax in [2^e, 2^(e+1)), biased exponent b = e + 127
    -> up = 2^(TOP - e), biased 254 + TOP - b, kept normal both ways (a zero row: 2^126)."""
    biased = 254 + TOP - ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF)
    biased = tl.minimum(tl.maximum(biased, 1), 253)
    return ((biased << 23).to(tl.float32, bitcast=True),
            ((254 - biased) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _gemv_fp8_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr,
    N, M, K, stride_xn, stride_on, stride_rn, k_per_split, eps, LOOP: tl.constexpr,
    SCALE_X: tl.constexpr, GEGLU: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, ROW_STAGES: tl.constexpr, ROW_AHEAD: tl.constexpr,
    PDL: tl.constexpr,
):
    rows, valid = weight_rows(M, BLOCK_M, GEGLU)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_dtype = x_ptr.dtype.element_ty
    if LOOP == ROW:  # NOTE: weights are no earlier kernel's output: load tiles before the wait
        w_0 = weight_tile(w_ptr, rows, valid, k_lo + rk, k_hi, K)
        if ROW_AHEAD == 2:  # the program's second tile (masked off where it has one)
            w_1 = weight_tile(w_ptr, rows, valid, k_lo + BLOCK_K + rk, k_hi, K)
    enter(PDL)
    if LOOP == DOT8:
        up, down = _pow2_scales(_row_amax(x_ptr, rn, k_lo, k_hi, N, stride_xn, BLOCK_N,
                                          BLOCK_K), 7)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w, x = _tiles(x_ptr, w_ptr, rows, valid, rn, k0 + rk, k_hi, N, K, stride_xn)
            q = round_e4m3(x.to(tl.float32) * up[:, None])
            acc = tl.dot(w, tl.trans(q.to(w_ptr.dtype.element_ty)), acc)
        y = tl.trans(acc) * down[:, None]
    elif LOOP == DOT16:
        if SCALE_X:
            up, down = _pow2_scales(_row_amax(x_ptr, rn, k_lo, k_hi, N, stride_xn, BLOCK_N,
                                              BLOCK_K), 14)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w, x = _tiles(x_ptr, w_ptr, rows, valid, rn, k0 + rk, k_hi, N, K, stride_xn)
            if SCALE_X:
                x = x.to(tl.float32) * up[:, None]
            acc = tl.dot(w.to(tl.float16), tl.trans(x.to(tl.float16)), acc)
        y = tl.trans(acc)
        if SCALE_X:
            y = y * down[:, None]
    elif LOOP == ROW:  # one row of x (BLOCK_N == 1): the weight tile's own layout throughout
        x = tl.load(x_ptr + k_lo + rk, mask=k_lo + rk < k_hi, other=0.0)
        acc2 = w_0.to(tl.float32) * x.to(tl.float32)[None, :]
        if ROW_AHEAD == 2:
            acc2 = _row_fma(acc2, w_1, x_ptr, k_lo + BLOCK_K + rk, k_hi)
        for k0 in tl.range(k_lo + ROW_AHEAD * BLOCK_K, k_hi, BLOCK_K, num_stages=ROW_STAGES):
            kk = k0 + rk
            acc2 = _row_fma(acc2, weight_tile(w_ptr, rows, valid, kk, k_hi, K), x_ptr, kk, k_hi)
        y = tl.sum(acc2, axis=1)[None, :]
    else:
        acc3 = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w, x = _tiles(x_ptr, w_ptr, rows, valid, rn, k0 + rk, k_hi, N, K, stride_xn)
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        y = tl.sum(acc3, axis=2)
    scale = tl.load(s_ptr + rows, mask=valid, other=0.0)
    finish(y * scale[None, :], rn, out_ptr, part_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr,
           res_out_ptr, N, M, stride_on, stride_rn, eps, x_dtype, GEGLU, NORM, NORM_BLOCK,
           BLOCK_N, BLOCK_M, SPLIT_K)


def gemv_fp8(x: torch.Tensor, weight: Fp8Matrix, config: GemvConfig = DEFAULT,
             geglu: bool = False, norm: NormEpilogue | None = None):
    """x: [N, K] any float, N <= 8 (rounded to weight.dtype first); weight: [M, K] FP8 ->
    as `gemv.gemv`: plain [N, M] in weight.dtype; geglu [N, M / 2]; norm (new residual f32,
    its rms_norm in norm.dtype)."""
    n, (m, k) = x.shape[0], weight.shape
    x = x if x.dtype == weight.dtype else x.to(weight.dtype)
    assert n == 1 or config.kind != "row", "the row loop reads one row of x"
    assert n <= MAX_ROWS and weight.data.is_contiguous() and x.stride(-1) == 1
    assert x.shape[1] == k and not (geglu and norm) and (not geglu or m % 2 == 0)
    c, dev = config, x.device
    k_per_split = cdiv(cdiv(k, c.split_k), c.block_k) * c.block_k
    splits, blocks = cdiv(k, k_per_split), cdiv(m, c.block_m)
    o = outputs(n, m, weight.dtype, splits, blocks, geglu, norm, dev)
    launch(
        _gemv_fp8_kernel, (blocks, splits), x, weight.data, weight.scales, *o.args, n, m, k,
        x.stride(0), o.args[0].stride(0), o.stride_rn, k_per_split, o.eps, LOOP=LOOPS[c.kind],
        SCALE_X=x.dtype != torch.float16, GEGLU=geglu, NORM=norm is not None,
        NORM_BLOCK=min(next_power_of_2(m), 4096),
        BLOCK_N=1 if c.kind == "row" else 16 if c.kind != "fma" else max(1, next_power_of_2(n)),
        BLOCK_M=c.block_m, BLOCK_K=c.block_k, SPLIT_K=splits,
        ROW_STAGES=c.num_stages if c.kind == "row" else 1,
        ROW_AHEAD=AHEAD if c.kind == "row" else 1, num_warps=c.num_warps,
        num_stages=c.num_stages, **options(dev))
    return o.result


def candidates_fp8(n: int, m: int, k: int) -> list[GemvConfig]:
    """The bfloat16 GEMV's configs for this shape, each of its tiles with twice the columns
    (the same bytes per load as a bfloat16 tile) when not split over K, every tensor-core
    config also with FP8 activations (dot8), and for one row the row loop's tiles."""
    base = candidates(n, m, k)
    wide = [dataclasses.replace(c, block_k=2 * c.block_k) for c in base
            if c.split_k == 1 and (c.kind == "dot" or n <= 2)]
    dot8 = [dataclasses.replace(c, kind="dot8") for c in base + wide if c.kind == "dot"]
    return base + wide + dot8 + (row_candidates(m, k) if n == 1 else [])


def row_candidates(m: int, k: int) -> list[GemvConfig]:
    """The row loop's tiles (16 codes a thread per load, four warps: eight won no 27B shape on
    the H200), split over K when the row blocks alone leave the chip's SMs short of programs to
    overlap; each loaded into registers as it is used (num_stages 1) and pipelined (3: two
    tiles ahead by cp.async; 5: four). Where 256 divides K but 512 does not (Gemma 3 27B's
    hidden 5,376 = 21 x 256), also 256-column tiles, so that no program ends on a half-masked
    tile."""
    shapes = [(8, 512), (16, 512), (8, 1024), (4, 2048)]
    if k % 256 == 0 and k % 512:
        shapes += [(16, 256), (32, 256)]
    out = []
    for bm, bk in shapes:
        programs = cdiv(m, bm)
        most = min(max(1, k // bk), 16)
        splits = {1} | ({min(s, most) for s in (2, 4)} if programs < 1024 else set())
        out += [GemvConfig("row", bm, bk, s, 4, stages) for s in sorted(splits)
                for stages in (1, 3, 5)]
    return out
