"""Decode GEMV: y[N, M] = x[N, K] @ W[M, K]^T for a few rows (N <= 8), streaming W once.

Two kernels, both split over M (BLOCK_M rows per program) and optionally over K (SPLIT_K
programs per row block, whose float32 partials a second kernel sums in a fixed order, so
results are deterministic and graph replay equals eager bit for bit):
- `_gemv_fma_kernel`: elementwise products accumulated in registers, reduced once at the end;
- `_gemv_dot_kernel`: the rows padded to 16 and fed to tensor cores, so Triton's pipeliner
  keeps several weight tiles in flight (cp.async stages).
With GEGLU the input is gate_up [N, 2K] and x = gelu_tanh(gate) * up is formed on load, so
the MLP's down projection reads gate_up directly (no intermediate tensor, one launch less).
x is rounded to the weight dtype before the product, as the reference's x.to(w.dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from muser.ops.triton.alloc import empty

MAX_ROWS = 8


@triton.jit
def gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))


@triton.jit
def _load_x(x_ptr, rn, kk, N, K, k_hi, stride_xn, w_dtype, GEGLU: tl.constexpr):
    """x[rn, kk] rounded to the weight dtype ([BLOCK_N, BLOCK_K]), zero at kk >= k_hi."""
    mask = (rn[:, None] < N) & (kk[None, :] < k_hi)
    at = x_ptr + rn[:, None] * stride_xn + kk[None, :]
    if GEGLU:
        gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(at + K, mask=mask, other=0.0).to(tl.float32)
        x = gelu_tanh(gate) * up
    else:
        x = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    return x.to(w_dtype)


@triton.jit
def _store_y(out_ptr, y, rn, rm, N, M, stride_on, SPLIT_K: tl.constexpr):
    """y: [BLOCK_N, BLOCK_M] float32 -> out; split over K: this split's slab of the float32
    partials [SPLIT_K, N, M], summed in a fixed order by _sum_splits_kernel (deterministic)."""
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    if SPLIT_K == 1:
        at = out_ptr + rn[:, None] * stride_on + rm[None, :]
    else:
        at = out_ptr + tl.program_id(1) * N * M + rn[:, None] * M + rm[None, :]
    tl.store(at, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, NM, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NM
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * NM + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_fma_kernel(
    x_ptr, w_ptr, out_ptr, N, M, K, stride_xn, stride_on, k_per_split,
    GEGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        w = tl.load(w_ptr + rm[:, None].to(tl.int64) * K + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        x = _load_x(x_ptr, rn, kk, N, K, k_hi, stride_xn, w_ptr.dtype.element_ty, GEGLU)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    _store_y(out_ptr, tl.sum(acc, axis=2), rn, rm, N, M, stride_on, SPLIT_K)


@triton.jit
def _gemv_dot_kernel(
    x_ptr, w_ptr, out_ptr, N, M, K, stride_xn, stride_on, k_per_split,
    GEGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        w = tl.load(w_ptr + rm[:, None].to(tl.int64) * K + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        x = _load_x(x_ptr, rn, kk, N, K, k_hi, stride_xn, w_ptr.dtype.element_ty, GEGLU)
        acc = tl.dot(w, tl.trans(x), acc)
    _store_y(out_ptr, tl.trans(acc), rn, rm, N, M, stride_on, SPLIT_K)


@dataclass(frozen=True)
class GemvConfig:
    kind: str  # "fma" | "dot"
    block_m: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int = 3


def gemv(x: torch.Tensor, weight: torch.Tensor, geglu: bool = False,
         config: GemvConfig = GemvConfig("fma", 4, 64, 1, 4)) -> torch.Tensor:
    """x: [N, K] (or gate_up [N, 2K] when geglu) any float, N <= 8; weight: [M, K] contiguous
    -> [N, M] in weight.dtype."""
    n, m, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert n <= MAX_ROWS and weight.is_contiguous() and x.stride(-1) == 1
    assert x.shape[1] == (2 * k if geglu else k), (x.shape, weight.shape)
    c = config
    k_per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    splits = triton.cdiv(k, k_per_split)
    out = empty((n, m), weight.dtype, x.device)
    part = empty((splits, n, m), torch.float32, x.device) if splits > 1 else out
    kernel = _gemv_dot_kernel if c.kind == "dot" else _gemv_fma_kernel
    block_n = 16 if c.kind == "dot" else max(1, triton.next_power_of_2(n))
    kernel[(triton.cdiv(m, c.block_m), splits)](
        x, weight, part, n, m, k, x.stride(0), out.stride(0), k_per_split, GEGLU=geglu,
        BLOCK_N=block_n, BLOCK_M=c.block_m, BLOCK_K=c.block_k, SPLIT_K=splits,
        num_warps=c.num_warps, num_stages=c.num_stages)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(n * m, 1024),)](part, out, n * m, SPLIT_K=splits,
                                                        BLOCK=1024)
    return out


def candidates(n: int, m: int, k: int) -> list[GemvConfig]:
    """Configs worth timing for one shape: a few tiles, split over K when M alone gives too
    few programs to fill the chip."""
    out = []
    for kind, bm, bk, warps in [("fma", 8, 512, 4), ("fma", 16, 512, 8), ("fma", 8, 1024, 8),
                                ("fma", 4, 1024, 4), ("dot", 64, 256, 4), ("dot", 128, 128, 4)]:
        if kind == "fma" and n > 2 and bm * bk > 4096:
            bm = max(1, 4096 // bk)
        programs = triton.cdiv(m, bm)
        splits = [1]
        if programs < 1024:  # too few programs to hide memory latency: also split K
            most = min(max(1, k // bk), 16)
            splits += [min(s, most) for s in (2, 4)]
            splits.append(min(triton.next_power_of_2(triton.cdiv(1024, programs)), most))
        for split in sorted(set(splits)):
            out.append(GemvConfig(kind, bm, bk, split, warps, 4 if kind == "dot" else 3))
    return out
