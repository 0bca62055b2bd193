"""Per-head RMSNorm then NeoX RoPE (rotate halves), one (row, head) per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.triton.alloc import empty


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xn, stride_xh, stride_c, eps,
    HALF: tl.constexpr,
):
    pid = tl.program_id(0)
    n, h = pid // H, pid % H
    d = tl.arange(0, HALF)
    base = x_ptr + n.to(tl.int64) * stride_xn + h * stride_xh
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
    x1 = x1 * inv * tl.load(w_ptr + d)
    x2 = x2 * inv * tl.load(w_ptr + HALF + d)
    c = tl.load(cos_ptr + n * stride_c + d)
    s = tl.load(sin_ptr + n * stride_c + d)
    out = out_ptr + pid.to(tl.int64) * 2 * HALF
    tl.store(out + d, x1 * c - x2 * s)
    tl.store(out + HALF + d, x2 * c + x1 * s)


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """x: [N, heads, head_dim] (any strides with a unit last stride) -> [N, heads, head_dim] f32;
    cos/sin: [N, head_dim // 2] f32; weight: [head_dim] f32."""
    n, heads, head_dim = x.shape
    half = head_dim // 2
    assert x.stride(2) == 1 and half == triton.next_power_of_2(half)
    assert cos.shape == (n, half) and cos.is_contiguous() and sin.is_contiguous()
    assert weight.dtype == torch.float32 and cos.dtype == torch.float32
    out = empty((n, heads, head_dim), torch.float32, x.device)
    if n:
        _qk_norm_rope_kernel[(n * heads,)](x, weight, cos, sin, out, heads, x.stride(0),
                                           x.stride(1), cos.stride(0), eps, HALF=half)
    return out
