"""Decode GEMV over GGUF blocks: y[N, M] = x[N, K] @ W[M, K]^T for a few rows (N <= 8), W read
once as the file's bytes and dequantized in registers (block_values), so a step reads the
file's size of weights, not its bfloat16 expansion. Split over M (BLOCK_M rows per program);
products accumulate in registers across K and are reduced once at the end, in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.blocks import KERNEL_TYPES, BlockMatrix
from muser.ops.triton.alloc import empty
from muser.ops.triton.block_values import block_values
from muser.ops.triton.launch import cdiv, launch, next_power_of_2
from muser.ops.triton.pdl import enter, options

MAX_ROWS = 8


@triton.jit
def _gemv_blocks_kernel(x_ptr, w_ptr, out_ptr, N, M, K, row_bytes, stride_xn, stride_on,
                        QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    base = w_ptr + rm[:, None].to(tl.int64) * row_bytes
    acc = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        w = block_values(base, kk[None, :], (rm[:, None] < M) & (kk[None, :] < K), QTYPE)
        x = tl.load(x_ptr + rn[:, None] * stride_xn + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)
    tl.store(out_ptr + rn[:, None] * stride_on + rm[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(rn[:, None] < N) & (rm[None, :] < M))


def linear_blocks(x: torch.Tensor, weight: BlockMatrix, block_m: int = 8,
                  block_k: int = 256, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, K] (float32, or 16-bit: read as float32), N <= 8; weight: [M, K] as Q5_0 / Q8_0 /
    Q4_K / Q6_K blocks -> [N, M] float32 (ref.linear_blocks), or written into `out` ([N, M] of
    any float dtype, rows of any stride: e.g. a column slice of a wider output)."""
    n, (m, k) = x.shape[0], weight.shape
    assert n <= MAX_ROWS and x.shape[1] == k and x.stride(-1) == 1 and x.dtype.is_floating_point
    assert weight.qtype in KERNEL_TYPES and weight.data.is_contiguous()
    if out is None:
        out = empty((n, m), torch.float32, x.device)
    assert out.shape == (n, m) and out.stride(-1) == 1
    launch(_gemv_blocks_kernel, (cdiv(m, block_m),), x, weight.data, out, n, m, k,
           weight.data.shape[1], x.stride(0), out.stride(0), QTYPE=int(weight.qtype),
           BLOCK_N=max(1, next_power_of_2(n)), BLOCK_M=block_m, BLOCK_K=block_k,
           **options(x.device))
    return out
