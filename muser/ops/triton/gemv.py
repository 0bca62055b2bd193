"""Decode GEMV: y[N, M] = x[N, K] @ W[M, K]^T for a few rows (N <= 8), streaming W once.

Each program owns BLOCK_M weight rows and walks K in BLOCK_K steps with 16-byte loads,
accumulating elementwise products and reducing once at the end (no per-step shuffles).
With GEGLU the input is gate_up [N, 2K] and x = gelu_tanh(gate) * up is formed on the fly,
so the MLP's down projection reads gate_up directly (no intermediate tensor, one launch less).
"""

from __future__ import annotations

import os

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
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, N, M, K, stride_xn, stride_on,
    GEGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        w = tl.load(w_ptr + rm[:, None].to(tl.int64) * K + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x_mask = (rn[:, None] < N) & k_mask[None, :]
        x_at = x_ptr + rn[:, None] * stride_xn + kk[None, :]
        if GEGLU:
            gate = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_at + K, mask=x_mask, other=0.0).to(tl.float32)
            x = gelu_tanh(gate) * up
        else:
            x = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
        # NOTE: round x to the weight dtype first, exactly as the reference's x.to(w.dtype).
        x = x.to(w_ptr.dtype.element_ty).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)
    out_mask = (rn[:, None] < N) & m_mask[None, :]
    tl.store(out_ptr + rn[:, None] * stride_on + rm[None, :], y.to(out_ptr.dtype.element_ty),
             mask=out_mask)


_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=nw, num_stages=ns)
    for bm, bk, nw, ns in [
        (4, 512, 4, 3), (8, 256, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 8, 3),
        (8, 1024, 8, 3), (4, 1024, 4, 3), (32, 256, 8, 3), (2, 1024, 4, 3),
    ]
]
_gemv_tuned = triton.autotune(_CONFIGS, key=["M", "K", "BLOCK_N", "GEGLU"])(_gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor, geglu: bool = False) -> torch.Tensor:
    """x: [N, K] (or gate_up [N, 2K] when geglu) any float, N <= 8; weight: [M, K] contiguous
    -> [N, M] in weight.dtype (the reference's rounding)."""
    n, m, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert n <= MAX_ROWS and weight.is_contiguous() and x.stride(-1) == 1
    assert x.shape[1] == (2 * k if geglu else k), (x.shape, weight.shape)
    out = empty((n, m), weight.dtype, x.device)
    block_n = max(1, triton.next_power_of_2(n))
    if os.environ.get("TRITON_INTERPRET") == "1":
        grid = (triton.cdiv(m, 4),)
        _gemv_kernel[grid](x, weight, out, n, m, k, x.stride(0), out.stride(0),
                           GEGLU=geglu, BLOCK_N=block_n, BLOCK_M=4, BLOCK_K=64)
        return out
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)  # noqa: E731
    _gemv_tuned[grid](x, weight, out, n, m, k, x.stride(0), out.stride(0),
                      GEGLU=geglu, BLOCK_N=block_n)
    return out
