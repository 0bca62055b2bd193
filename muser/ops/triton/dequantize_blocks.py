"""GGUF blocks -> a dense matrix in one pass: the prefill route's workspace (a tensor-core GEMM
then runs on the values), or a check of the block readers against gguf's dequantization."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.blocks import KERNEL_TYPES, BlockMatrix
from muser.ops.triton.alloc import empty
from muser.ops.triton.block_values import block_values
from muser.ops.triton.launch import cdiv, launch
from muser.ops.triton.pdl import enter, options


@triton.jit
def _dequantize_blocks_kernel(w_ptr, d_ptr, out_ptr, M, K, row_bytes, d_row,
                              QTYPE: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)  # NOTE: before writing: the workspace it fills is the last projection's input
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M) & (kk[None, :] < K)
    base = w_ptr + rm[:, None].to(tl.int64) * row_bytes
    w = block_values(base, kk[None, :], mask, d_ptr + rm[:, None].to(tl.int64) * d_row, QTYPE)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * K + kk[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_blocks(weight: BlockMatrix, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """weight: [M, K] as blocks of a KERNEL_TYPES type -> [M, K] in `dtype`
    (ref.dequantize_blocks), or written into `out` (contiguous [M, K] of `dtype`: e.g. rows
    of a reused workspace)."""
    assert weight.qtype in KERNEL_TYPES and weight.data.is_contiguous()
    m, k = weight.shape
    if out is None:
        out = empty((m, k), dtype, weight.data.device)
    assert out.shape == (m, k) and out.dtype == dtype and out.is_contiguous()
    block_m, block_k = 16, 256
    d = weight.d if weight.d is not None else out  # unread but by Q8_0 and Q6_K
    launch(_dequantize_blocks_kernel, (cdiv(m, block_m), cdiv(k, block_k)), weight.data, d,
           out, m, k, weight.data.stride(0), d.stride(0), QTYPE=int(weight.qtype),
           BLOCK_M=block_m, BLOCK_K=block_k, **options(weight.data.device))
    return out
