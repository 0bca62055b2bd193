"""FP8 weights -> a dense matrix in one pass: data * scales rounded once to the model dtype
(Fp8Matrix.dequantize's values), the workspace of the prefill route that runs a bfloat16
tensor-core GEMM instead of an FP8 one (muser/ops/triton/linear_fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.fp8 import Fp8Matrix
from muser.ops.triton.alloc import empty
from muser.ops.triton.launch import cdiv, launch


@triton.jit
def _dequantize_fp8_kernel(w_ptr, s_ptr, out_ptr, M, K, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M) & (kk[None, :] < K)
    at = rm[:, None].to(tl.int64) * K + kk[None, :]
    w = tl.load(w_ptr + at, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rm, mask=rm < M, other=0.0)
    tl.store(out_ptr + at, (w * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp8(weight: Fp8Matrix) -> torch.Tensor:
    """weight: [M, K] FP8 -> [M, K] in weight.dtype, bit for bit weight.dequantize(dtype)."""
    assert weight.data.is_contiguous()
    (m, k), block_m, block_k = weight.shape, 32, 256
    out = empty((m, k), weight.dtype, weight.data.device)
    launch(_dequantize_fp8_kernel, (cdiv(m, block_m), cdiv(k, block_k)), weight.data,
           weight.scales, out, m, k, BLOCK_M=block_m, BLOCK_K=block_k)
    return out
