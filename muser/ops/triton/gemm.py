"""Prefill GEMM: y[N, M] = x[N, K] @ W[M, K]^T on tensor cores, with the op after the projection
in its epilogue, so a chunk's projection and that op are one launch:

- plain: y in the weight dtype (the QKV projection);
- GEGLU (W = [gate; up]): gelu_tanh(gate) * up [N, I]; no gate_up tensor in between;
- NORM: the residual add + RMSNorm pair after o_proj and down. Each program stores its tile of
  y (rounded to the weight dtype) as float32 into the new residual; the last program of a row
  block to finish (`arrive`) normalizes those rows: h = residual + rms_norm(y, post) in place,
  then rms_norm(h, next).

The epilogues are the decode GEMV's (`gemv.epilogue`), over a tile of rows instead of all of
them. At a small model's chunk widths prefill is host-bound, and one launch here replaces a
cuBLAS call, an allocation and a kernel: `linear` times both per shape and runs the faster.

Given `k_per_split` (the exact route, muser/ops/triton/order.py), K is cut at those fixed
offsets: each cut's sum is a chain of dots of its own, from zero, and the cuts' sums are added
in order, in registers: the same float32 arithmetic as the decode GEMV's split-K programs and
their last arriver's sum, so a row's bits do not depend on the width it runs at (a chain of
16-bit dots sums alike whatever the tile's shape or operand order: bench/exact_probe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from muser.ops.triton.alloc import empty
from muser.ops.triton.arrive import arrive, counters
from muser.ops.triton.gemv import (
    SCALED_KINDS,
    NormEpilogue,
    block_rows,
    e4m3_values,
    epilogue_at,
)
from muser.ops.triton.launch import cdiv, launch, next_power_of_2
from muser.ops.triton.pdl import enter, options


@triton.jit
def _rows_norm(y_ptr, res_ptr, post_ptr, next_ptr, out_ptr, r0, end, M, stride_rn, stride_on,
               eps, ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    """Rows r0 .. r0 + ROWS (those < end): h = res + rms_norm(y, post) over y_ptr in place, out =
    rms_norm(h, next) (ref.add_rms_norm), in passes over BLOCK_E columns."""
    r = r0 + tl.arange(0, ROWS)
    live = r[:, None] < end
    y_at = y_ptr + r[:, None].to(tl.int64) * M
    sq = tl.zeros((ROWS, BLOCK_E), tl.float32)
    for m0 in range(0, M, BLOCK_E):
        e = m0 + tl.arange(0, BLOCK_E)
        y = tl.load(y_at + e[None, :], mask=live & (e[None, :] < M), other=0.0,
                    cache_modifier=".cg")
        sq += y * y
    inv = tl.rsqrt(tl.sum(sq, axis=1) / M + eps)
    sq = tl.zeros((ROWS, BLOCK_E), tl.float32)
    for m0 in range(0, M, BLOCK_E):
        e = m0 + tl.arange(0, BLOCK_E)
        mask = live & (e[None, :] < M)
        y = tl.load(y_at + e[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        res = tl.load(res_ptr + r[:, None].to(tl.int64) * stride_rn + e[None, :], mask=mask,
                      other=0.0)
        post = tl.load(post_ptr + e, mask=e < M, other=0.0)
        h = res + y * inv[:, None] * post[None, :]
        tl.store(y_at + e[None, :], h, mask=mask)
        sq += h * h
    tl.debug_barrier()
    inv = tl.rsqrt(tl.sum(sq, axis=1) / M + eps)
    for m0 in range(0, M, BLOCK_E):
        e = m0 + tl.arange(0, BLOCK_E)
        mask = live & (e[None, :] < M)
        h = tl.load(y_at + e[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        out = h * inv[:, None] * tl.load(next_ptr + e, mask=e < M, other=0.0)[None, :]
        tl.store(out_ptr + r[:, None].to(tl.int64) * stride_on + e[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot_range(x_ptr, w_ptr, rn, rows, valid, k_lo, k_hi, N, K, stride_xn, w_dtype,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               SCALED: tl.constexpr):
    """sum over k in [k_lo, k_hi) of x[rn, k] * W[rows, k]: one chain of tensor-core dots from
    zero, BLOCK_K columns at a time -> float32 [BLOCK_N, BLOCK_M]."""
    rk = tl.arange(0, BLOCK_K)
    x_at = x_ptr + rn[:, None].to(tl.int64) * stride_xn + (k_lo + rk)[None, :]
    w_at = w_ptr + rows[:, None].to(tl.int64) * K + (k_lo + rk)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_in = rk[None, :] < k_hi - k0
        x = tl.load(x_at, mask=(rn[:, None] < N) & k_in, other=0.0)
        w = tl.load(w_at, mask=valid[:, None] & k_in, other=0.0)
        if SCALED:  # FP8 codes read as bytes (gemv.e4m3_values)
            w = e4m3_values(w)
        # NOTE: "ieee": float32 weights multiply in float32 (Triton's default for them is TF32,
        # 10-bit mantissas); 16-bit ones are unaffected
        acc = tl.dot(x.to(w_dtype), tl.trans(w.to(w_dtype)), acc, input_precision="ieee")
        x_at += BLOCK_K
        w_at += BLOCK_K
    return acc


# NOTE: row counts vary from one forward to the next; left unspecialized, they need no compile the
# warm-up did not do (muser/startup/warmup.py)
@triton.jit(do_not_specialize=["N"])
def _gemm_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr, N, M,
    K, stride_xn, stride_on, stride_rn, eps, k_per_split, GEGLU: tl.constexpr,
    NORM: tl.constexpr, NORM_ROWS: tl.constexpr, NORM_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, CUTS: tl.constexpr,
    SCALED: tl.constexpr, PDL: tl.constexpr,
):
    """Program (j, i): x rows of block j, weight rows of block i (`block_rows`): the programs
    running at once share weight blocks, so each weight tile is read from memory about once and
    x's tiles come from L2 (x is the small operand of a prefill chunk). SCALED: the
    weight is FP8 codes with a scale per row (gemv.py's SCALED kinds), each cut's sums times
    its rows' scales in a fused multiply-add into the total, as the GEMV's `finish` adds them
    (an explicit one: a multiply then an add would be fused here and not there)."""
    block, row_block = tl.program_id(1), tl.program_id(0)
    rows, valid = block_rows(block, M, BLOCK_M, GEGLU)
    rn = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    w_dtype = w_ptr.dtype.element_ty
    if SCALED == 1:  # SCALED_BF16
        w_dtype = tl.bfloat16
    elif SCALED == 2:  # SCALED_F16
        w_dtype = tl.float16
    enter(PDL)
    if SCALED:
        scale = tl.load(scale_ptr + rows, mask=valid, other=0.0)[None, :]
    if CUTS:  # K cut at fixed offsets, the cuts' sums added in order (order.py)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for k_lo in range(0, K, k_per_split):
            part = _dot_range(x_ptr, w_ptr, rn, rows, valid, k_lo,
                              tl.minimum(k_lo + k_per_split, K), N, K, stride_xn, w_dtype,
                              BLOCK_N, BLOCK_M, BLOCK_K, SCALED)
            if SCALED:
                acc = tl.fma(part, scale, acc)
            else:
                acc += part
    else:
        acc = _dot_range(x_ptr, w_ptr, rn, rows, valid, 0, K, N, K, stride_xn, w_dtype,
                         BLOCK_N, BLOCK_M, BLOCK_K, SCALED)
        if SCALED:
            acc = acc * scale
    if NORM:
        y = acc.to(w_dtype).to(tl.float32)
        rm = block * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(res_out_ptr + rn[:, None].to(tl.int64) * M + rm[None, :], y,
                 mask=(rn[:, None] < N) & (rm[None, :] < M))
        if arrive(cnt_ptr + row_block, tl.num_programs(1)):  # this row block's last
            end = tl.minimum(N, (row_block + 1) * BLOCK_N)
            for r0 in range(row_block * BLOCK_N, end, NORM_ROWS):
                _rows_norm(res_out_ptr, res_ptr, post_ptr, next_ptr, out_ptr, r0, end, M,
                           stride_rn, stride_on, eps, NORM_ROWS, NORM_BLOCK)
    else:
        epilogue_at(block, acc, rn, out_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr,
                    N, M, stride_on, stride_rn, eps, w_dtype, GEGLU, False, NORM_BLOCK, BLOCK_N,
                    BLOCK_M)


@dataclass(frozen=True)
class GemmConfig:
    block_n: int  # x rows per program
    block_m: int  # weight rows per program (with GeGLU, half gate and half up rows)
    block_k: int
    num_warps: int
    num_stages: int


CANDIDATES = [GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 128, 64, 8, 3),
              GemmConfig(64, 128, 64, 4, 3),
              GemmConfig(32, 64, 64, 4, 3)]
SMALL = GemmConfig(16, 32, 32, 4, 2)  # the interpreter's


def gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig = SMALL,
         geglu: bool = False, norm: NormEpilogue | None = None, k_per_split: int | None = None,
         scales: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """x: [N, K] any float; weight: [M, K] contiguous -> as `gemv.gemv`: plain [N, M] in
    weight.dtype; geglu [N, M / 2]; norm (new residual f32, its rms_norm in norm.dtype).
    k_per_split: K cut at these offsets, in the GEMV's order (a multiple of config.block_k).
    scales, dtype: FP8 codes with a scale per row, as `gemv.gemv`."""
    n, m, k = x.shape[0], weight.shape[0], weight.shape[1]
    scaled = 0 if scales is None else SCALED_KINDS[dtype]
    out_dtype = dtype if scaled else weight.dtype
    assert weight.is_contiguous() and x.stride(-1) == 1 and x.shape[1] == k
    assert not (geglu and norm) and (not geglu or m % 2 == 0)
    assert k_per_split is None or k_per_split % config.block_k == 0
    c, dev = config, x.device
    row_blocks = cdiv(n, c.block_n)
    res = post = nxt = res_out = None
    cnt = None
    if norm is not None:
        assert norm.residual.shape == (n, m) and norm.residual.stride(-1) == 1
        out = empty((n, m), norm.dtype, dev)
        res_out = empty((n, m), torch.float32, dev)
        res, post, nxt = norm.residual, norm.post, norm.next
        cnt = counters(dev, row_blocks)
    else:
        out = empty((n, m // 2 if geglu else m), out_dtype, dev)
    norm_block = min(next_power_of_2(m), 1024)
    launch(
        _gemm_kernel, (row_blocks, cdiv(m, c.block_m)), x,
        weight.view(torch.uint8) if scaled else weight,
        weight if scales is None else scales, out,
        cnt if cnt is not None else out, res if res is not None else out,
        post if post is not None else out, nxt if nxt is not None else out,
        res_out if res_out is not None else out, n, m, k, x.stride(0), out.stride(0),
        res.stride(0) if res is not None else 0, norm.eps if norm is not None else 0.0,
        k_per_split or k, GEGLU=geglu, NORM=norm is not None,
        NORM_ROWS=min(c.block_n, max(1, 4096 // norm_block)), NORM_BLOCK=norm_block,
        BLOCK_N=c.block_n, BLOCK_M=c.block_m, BLOCK_K=c.block_k,
        CUTS=k_per_split is not None and k_per_split < k, SCALED=scaled,
        num_warps=c.num_warps, num_stages=c.num_stages, **options(dev))
    return (res_out, out) if norm is not None else out
