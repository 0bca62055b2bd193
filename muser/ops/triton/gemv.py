"""Decode GEMV: y[N, M] = x[N, K] @ W[M, K]^T for a few rows (N <= 8), streaming W once, with
the step's next small op fused into its epilogue.

Two main loops, both split over M (BLOCK_M rows per program) and optionally over K (SPLIT_K
programs per row block):
- `_gemv_fma_kernel`: elementwise products accumulated in registers, reduced once at the end;
- `_gemv_dot_kernel`: the rows padded to 16 and fed to tensor cores, so Triton's pipeliner
  keeps several weight tiles in flight (cp.async stages).
Split over K, each program stores a float32 partial and the last of a row block to finish sums
them in a fixed order (`arrive`): deterministic, so graph replay equals eager bit for bit.

Epilogues (y rounded to the weight dtype first, as the reference's projection output):
- plain: y in the weight dtype;
- GEGLU (W = [gate; up], 2I rows): a program's rows interleave gate row j and up row j, and it
  writes gelu_tanh(gate) * up [N, I]: the MLP's activation, no gate_up tensor in between;
- NORM: the residual add + RMSNorm pair after o_proj and down (`ops.add_rms_norm`), done by the
  last program of the whole launch over the full rows -> (new residual f32, normed input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from muser.ops.triton.alloc import empty
from muser.ops.triton.arrive import arrive, counters
from muser.ops.triton.launch import cdiv, launch, next_power_of_2
from muser.ops.triton.pdl import enter, options

MAX_ROWS = 8
DOT_ROWS = 64  # the tensor-core kind's most rows (the exact route's decode batches: linear.py)
# SCALED: the weight is FP8 codes with a float32 scale per row (Fp8Matrix), multiplied as
# 16-bit values of this dtype (the model's); 0: a plain weight, multiplied in its own dtype
SCALED_BF16, SCALED_F16 = 1, 2
SCALED_KINDS = {torch.bfloat16: SCALED_BF16, torch.float16: SCALED_F16}


@triton.jit
def gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))


@triton.jit
def e4m3_values(codes):
    """e4m3 codes read as uint8 -> their values in float32, exactly, by bit arithmetic: one
    conversion in every kernel and tile layout (Triton lowers its own fp8 conversion per
    layout, and an H100 run found FP8 rows apart between GEMM tiles where bf16's agreed)."""
    c = codes.to(tl.int32)
    e, m = (c >> 3) & 15, c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m 2^-9
    return (value.to(tl.int32, bitcast=True) | ((c & 128) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def weight_rows(M, BLOCK_M: tl.constexpr, GEGLU: tl.constexpr):
    """This program's weight rows (block program_id(0)) and their validity."""
    return block_rows(tl.program_id(0), M, BLOCK_M, GEGLU)


@triton.jit
def block_rows(block, M, BLOCK_M: tl.constexpr, GEGLU: tl.constexpr):
    """Weight row block `block`'s rows and their validity. With GEGLU, row r of the block is
    gate row j = r // 2 (r even) or up row j (r odd) of output column block * BLOCK_M / 2 + j."""
    r = tl.arange(0, BLOCK_M)
    if GEGLU:
        col = block * (BLOCK_M // 2) + r // 2
        return (r % 2) * (M // 2) + col, col < M // 2
    rm = block * BLOCK_M + r
    return rm, rm < M


@triton.jit
def weight_tile(w_ptr, rows, valid, kk, k_hi, K):
    """The weight tile [BLOCK_M, BLOCK_K] of `rows` at columns kk (0 where not valid or past
    k_hi)."""
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + kk[None, :],
                   mask=valid[:, None] & (kk[None, :] < k_hi), other=0.0)


@triton.jit
def x_tile(x_ptr, rn, kk, k_hi, N, stride_xn):
    """x's rows rn at columns kk [BLOCK_N, BLOCK_K] (0 past N and k_hi)."""
    return tl.load(x_ptr + rn[:, None] * stride_xn + kk[None, :],
                   mask=(rn[:, None] < N) & (kk[None, :] < k_hi), other=0.0)


@triton.jit
def tiles(x_ptr, w_ptr, rows, valid, rn, kk, k_hi, N, K, stride_xn):
    """The weight tile at columns kk and x's tile there."""
    w = weight_tile(w_ptr, rows, valid, kk, k_hi, K)
    return w, x_tile(x_ptr, rn, kk, k_hi, N, stride_xn)


@triton.jit
def _row_norm(y_ptr, res_ptr, post_ptr, next_ptr, out_ptr, N, M, stride_rn, eps,
              BLOCK_E: tl.constexpr):
    """For each row n: h = res + rms_norm(y, post) (over y_ptr in place), out = rms_norm(h,
    next): ref.add_rms_norm. A row that fits one block is loaded at once (one memory round
    trip: this runs in a single program, after all others); wider rows take three passes."""
    if M <= BLOCK_E:
        e = tl.arange(0, BLOCK_E)
        mask = e < M
        post = tl.load(post_ptr + e, mask=mask, other=0.0)
        nxt = tl.load(next_ptr + e, mask=mask, other=0.0)
        for n in range(N):
            y = tl.load(y_ptr + n * M + e, mask=mask, other=0.0, cache_modifier=".cg")
            r = tl.load(res_ptr + n * stride_rn + e, mask=mask, other=0.0)
            h = r + y * tl.rsqrt(tl.sum(y * y, axis=0) / M + eps) * post
            tl.store(y_ptr + n * M + e, h, mask=mask)
            out = h * tl.rsqrt(tl.sum(h * h, axis=0) / M + eps) * nxt
            tl.store(out_ptr + n * M + e, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        for n in range(N):
            sq = tl.zeros((BLOCK_E,), tl.float32)
            for m0 in range(0, M, BLOCK_E):
                e = m0 + tl.arange(0, BLOCK_E)
                y = tl.load(y_ptr + n * M + e, mask=e < M, other=0.0, cache_modifier=".cg")
                sq += y * y
            inv = tl.rsqrt(tl.sum(sq, axis=0) / M + eps)
            sq = tl.zeros((BLOCK_E,), tl.float32)
            for m0 in range(0, M, BLOCK_E):
                e = m0 + tl.arange(0, BLOCK_E)
                mask = e < M
                y = tl.load(y_ptr + n * M + e, mask=mask, other=0.0, cache_modifier=".cg")
                r = tl.load(res_ptr + n * stride_rn + e, mask=mask, other=0.0)
                h = r + y * inv * tl.load(post_ptr + e, mask=mask, other=0.0)
                tl.store(y_ptr + n * M + e, h, mask=mask)
                sq += h * h
            tl.debug_barrier()
            inv = tl.rsqrt(tl.sum(sq, axis=0) / M + eps)
            for m0 in range(0, M, BLOCK_E):
                e = m0 + tl.arange(0, BLOCK_E)
                mask = e < M
                h = tl.load(y_ptr + n * M + e, mask=mask, other=0.0, cache_modifier=".cg")
                y = h * inv * tl.load(next_ptr + e, mask=mask, other=0.0)
                tl.store(out_ptr + n * M + e, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def epilogue(y, rn, out_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr, N, M,
             stride_on, stride_rn, eps, w_dtype, GEGLU: tl.constexpr, NORM: tl.constexpr,
             NORM_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """y: this block's (program_id(0)'s) complete float32 sums [BLOCK_N, BLOCK_M] -> the
    launch's outputs."""
    epilogue_at(tl.program_id(0), y, rn, out_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr,
                res_out_ptr, N, M, stride_on, stride_rn, eps, w_dtype, GEGLU, NORM, NORM_BLOCK,
                BLOCK_N, BLOCK_M)


@triton.jit
def epilogue_at(block, y, rn, out_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr, N,
                M, stride_on, stride_rn, eps, w_dtype, GEGLU: tl.constexpr, NORM: tl.constexpr,
                NORM_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """`epilogue` of weight row block `block`."""
    y = y.to(w_dtype).to(tl.float32)
    if GEGLU:
        gate, up = tl.split(tl.reshape(y, (BLOCK_N, BLOCK_M // 2, 2)))
        col = block * (BLOCK_M // 2) + tl.arange(0, BLOCK_M // 2)
        mask = (rn[:, None] < N) & (col[None, :] < M // 2)
        tl.store(out_ptr + rn[:, None] * stride_on + col[None, :],
                 (gelu_tanh(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        rm = block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rn[:, None] < N) & (rm[None, :] < M)
        if NORM:  # y -> res_out (f32); the launch's last program normalizes the full rows
            tl.store(res_out_ptr + rn[:, None] * M + rm[None, :], y, mask=mask)
            if arrive(cnt_ptr + tl.num_programs(0), tl.num_programs(0)):
                _row_norm(res_out_ptr, res_ptr, post_ptr, next_ptr, out_ptr, N, M, stride_rn,
                          eps, NORM_BLOCK)
        else:
            tl.store(out_ptr + rn[:, None] * stride_on + rm[None, :],
                     y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def finish(acc, rn, out_ptr, part_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr, N,
           M, stride_on, stride_rn, eps, w_dtype, GEGLU: tl.constexpr, NORM: tl.constexpr,
           NORM_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
           SPLIT_K: tl.constexpr, scale=1.0, SCALED: tl.constexpr = False):
    """acc: this program's float32 sums [BLOCK_N, BLOCK_M] over its K range. SCALED: the
    block's sums over K (each cut's, in order) times `scale` [BLOCK_M], a fused multiply-add
    into the total each: gemm.py's order, where the compiler would fuse a multiply and an add
    anyway."""
    if SPLIT_K == 1:
        if SCALED:
            acc = acc * scale[None, :]
        epilogue(acc, rn, out_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr, N, M,
                 stride_on, stride_rn, eps, w_dtype, GEGLU, NORM, NORM_BLOCK, BLOCK_N, BLOCK_M)
    else:
        v = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows in program order
        at = part_ptr + rn[:, None] * M + v[None, :]
        mask = (rn[:, None] < N) & (v[None, :] < M)
        tl.store(at + tl.program_id(1) * N * M, acc, mask=mask)
        if arrive(cnt_ptr + tl.program_id(0), SPLIT_K):
            total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for s in tl.static_range(SPLIT_K):
                part = tl.load(at + s * N * M, mask=mask, other=0.0, cache_modifier=".cg")
                if SCALED:
                    total = tl.fma(part, scale[None, :], total)
                else:
                    total += part
            epilogue(total, rn, out_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr,
                     N, M, stride_on, stride_rn, eps, w_dtype, GEGLU, NORM, NORM_BLOCK, BLOCK_N,
                     BLOCK_M)


@triton.jit
def _gemv_fma_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr,
    res_out_ptr, N, M, K, stride_xn, stride_on, stride_rn, k_per_split, eps,
    GEGLU: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    tl.static_assert(SCALED == 0)  # FP8 codes: the tensor-core kind only
    rows, valid = weight_rows(M, BLOCK_M, GEGLU)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_dtype = w_ptr.dtype.element_ty
    enter(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w, x = tiles(x_ptr, w_ptr, rows, valid, rn, k0 + rk, k_hi, N, K, stride_xn)
        acc += x.to(w_dtype).to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    finish(tl.sum(acc, axis=2), rn, out_ptr, part_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr,
           res_out_ptr, N, M, stride_on, stride_rn, eps, w_dtype, GEGLU, NORM, NORM_BLOCK,
           BLOCK_N, BLOCK_M, SPLIT_K)


@triton.jit
def _gemv_dot_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr,
    res_out_ptr, N, M, K, stride_xn, stride_on, stride_rn, k_per_split, eps,
    GEGLU: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    rows, valid = weight_rows(M, BLOCK_M, GEGLU)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_dtype = w_ptr.dtype.element_ty
    if SCALED == 1:  # SCALED_BF16
        w_dtype = tl.bfloat16
    elif SCALED == 2:  # SCALED_F16
        w_dtype = tl.float16
    enter(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w, x = tiles(x_ptr, w_ptr, rows, valid, rn, k0 + rk, k_hi, N, K, stride_xn)
        if SCALED:  # as gemm.py's: FP8 codes become 16-bit values exactly
            w = e4m3_values(w)
        acc = tl.dot(w.to(w_dtype), tl.trans(x.to(w_dtype)), acc, input_precision="ieee")
    scale = 1.0
    if SCALED:  # each cut's sums times the rows' scales as the cuts are added (finish)
        scale = tl.load(scale_ptr + rows, mask=valid, other=0.0)
    finish(tl.trans(acc), rn, out_ptr, part_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr,
           res_out_ptr, N, M, stride_on, stride_rn, eps, w_dtype, GEGLU, NORM, NORM_BLOCK,
           BLOCK_N, BLOCK_M, SPLIT_K, scale, SCALED)


@dataclass(frozen=True)
class GemvConfig:
    kind: str  # "fma" | "dot"
    block_m: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int = 3
    fused: bool = True  # the epilogue (GeGLU / norm) in this kernel, or as its own kernel after


@dataclass(frozen=True)
class NormEpilogue:
    """ops.add_rms_norm(residual, y, post, next, eps, dtype) applied to the GEMV's output y."""
    residual: torch.Tensor
    post: torch.Tensor
    next: torch.Tensor
    eps: float
    dtype: torch.dtype


DEFAULT = GemvConfig("fma", 4, 64, 1, 4)


@dataclass(frozen=True)
class Outputs:
    """A GEMV launch's output and scratch tensors, in its kernels' argument order (out, part,
    cnt, res, post, next, res_out: unused ones stand in as `out`), and what the call returns."""
    args: tuple
    stride_rn: int
    eps: float
    result: object


def outputs(n: int, m: int, dtype: torch.dtype, splits: int, blocks: int, geglu: bool,
            norm: NormEpilogue | None, device: torch.device) -> Outputs:
    """The tensors of a GEMV of [n, m] in `dtype` over `blocks` row blocks split `splits`
    ways over K, with GeGLU or the norm epilogue (as `gemv` returns them)."""
    if norm is not None:
        assert norm.residual.shape == (n, m) and norm.residual.stride(-1) == 1
        out = empty((n, m), norm.dtype, device)
        res_out = empty((n, m), torch.float32, device)
    else:
        out = empty((n, m // 2 if geglu else m), dtype, device)
    needed = (blocks if splits > 1 else 0) + (blocks + 1 if norm is not None else 0)
    cnt = counters(device, needed) if needed else out
    part = empty((splits, n, m), torch.float32, device) if splits > 1 else out
    if norm is None:
        return Outputs((out, part, cnt, out, out, out, out), 0, 0.0, out)
    return Outputs((out, part, cnt, norm.residual, norm.post, norm.next, res_out),
                   norm.residual.stride(0), norm.eps, (res_out, out))


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig = DEFAULT,
         geglu: bool = False, norm: NormEpilogue | None = None, k_per_split: int | None = None,
         scales: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """x: [N, K] any float, N <= 8 (the tensor-core kind: DOT_ROWS); weight: [M, K] contiguous ->
    plain: [N, M] in weight.dtype; geglu: gelu_tanh(y[:, :M/2]) * y[:, M/2:] [N, M/2] in
    weight.dtype; norm: (residual + rms_norm(y, post) f32, its rms_norm by next in norm.dtype).
    k_per_split: K cut at these offsets (the exact route's order, order.py; a multiple of
    config.block_k) instead of config.split_k ways. scales ([M] float32) with dtype: weight is
    FP8 codes (float8_e4m3fn, read as bytes), row m's values codes * scales[m], multiplied as
    `dtype` values (the tensor-core kind), outputs in `dtype`."""
    n, m, k = x.shape[0], weight.shape[0], weight.shape[1]
    scaled = 0 if scales is None else SCALED_KINDS[dtype]
    assert not scaled or config.kind == "dot"
    assert n <= (DOT_ROWS if config.kind == "dot" else MAX_ROWS)
    assert weight.is_contiguous() and x.stride(-1) == 1 and x.shape[1] == k
    assert not (geglu and norm) and (not geglu or m % 2 == 0)
    c = config
    if k_per_split is None:
        k_per_split = cdiv(cdiv(k, c.split_k), c.block_k) * c.block_k
    assert k_per_split % c.block_k == 0
    splits = cdiv(k, k_per_split)
    blocks = cdiv(m, c.block_m)
    dev = x.device
    o = outputs(n, m, dtype if scaled else weight.dtype, splits, blocks, geglu, norm, dev)
    kernel = _gemv_dot_kernel if c.kind == "dot" else _gemv_fma_kernel
    block_n = max(16, next_power_of_2(n)) if c.kind == "dot" else max(1, next_power_of_2(n))
    launch(
        kernel, (blocks, splits), x, weight.view(torch.uint8) if scaled else weight,
        weight if scales is None else scales, *o.args, n,
        m, k, x.stride(0), o.args[0].stride(0), o.stride_rn, k_per_split, o.eps, GEGLU=geglu,
        NORM=norm is not None, NORM_BLOCK=min(next_power_of_2(m), 4096), BLOCK_N=block_n,
        BLOCK_M=c.block_m, BLOCK_K=c.block_k, SPLIT_K=splits, SCALED=scaled,
        num_warps=c.num_warps, num_stages=c.num_stages, **options(dev))
    return o.result


def candidates(n: int, m: int, k: int) -> list[GemvConfig]:
    """Configs worth timing for one shape: a few tiles, split over K when M alone gives too
    few programs to fill the chip."""
    out = []
    for kind, bm, bk, warps in [("fma", 8, 512, 4), ("fma", 16, 512, 8), ("fma", 8, 1024, 8),
                                ("fma", 4, 1024, 4), ("dot", 64, 256, 4), ("dot", 128, 128, 4)]:
        if kind == "fma" and n > 2 and bm * bk > 4096:
            bm = max(2, 4096 // bk)
        programs = cdiv(m, bm)
        splits = [1]
        if programs < 1024:  # too few programs to hide memory latency: also split K
            most = min(max(1, k // bk), 16)
            splits += [min(s, most) for s in (2, 4, 8)]
            splits.append(min(next_power_of_2(cdiv(1024, programs)), most))
        for split in sorted(set(splits)):
            out.append(GemvConfig(kind, bm, bk, split, warps, 4 if kind == "dot" else 3))
    return out
