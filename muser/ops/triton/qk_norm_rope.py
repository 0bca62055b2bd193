"""Per-head RMSNorm then NeoX RoPE (rotate halves), one (row, head) per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.triton.alloc import empty
from muser.ops.triton.launch import launch, next_power_of_2
from muser.ops.triton.pdl import enter, options


@triton.jit
def _norm_rope_head(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n, h, H, stride_xn, stride_xh,
                    stride_c, eps, HALF: tl.constexpr):
    d = tl.arange(0, HALF)
    base = x_ptr + n.to(tl.int64) * stride_xn + h * stride_xh
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
    x1 = x1 * inv * tl.load(w_ptr + d)
    x2 = x2 * inv * tl.load(w_ptr + HALF + d)
    c = tl.load(cos_ptr + n * stride_c + d)
    s = tl.load(sin_ptr + n * stride_c + d)
    out = out_ptr + (n.to(tl.int64) * H + h) * 2 * HALF
    tl.store(out + d, x1 * c - x2 * s)
    tl.store(out + HALF + d, x2 * c + x1 * s)


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xn, stride_xh, stride_c, eps,
    HALF: tl.constexpr, PDL: tl.constexpr,
):
    enter(PDL)
    pid = tl.program_id(0)
    _norm_rope_head(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, pid // H, pid % H, H, stride_xn,
                    stride_xh, stride_c, eps, HALF)


@triton.jit
def _qk_pair_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out, k_out, H, KVH, stride_qn, stride_qh,
    stride_kn, stride_kh, stride_c, eps, HALF: tl.constexpr, PDL: tl.constexpr,
):
    enter(PDL)
    pid = tl.program_id(0)
    n, h = pid // (H + KVH), pid % (H + KVH)
    if h < H:
        _norm_rope_head(q_ptr, qw_ptr, cos_ptr, sin_ptr, q_out, n, h, H, stride_qn, stride_qh,
                        stride_c, eps, HALF)
    else:
        _norm_rope_head(k_ptr, kw_ptr, cos_ptr, sin_ptr, k_out, n, h - H, KVH, stride_kn,
                        stride_kh, stride_c, eps, HALF)


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """x: [N, heads, head_dim] (any strides with a unit last stride) -> [N, heads, head_dim] f32;
    cos/sin: [N, head_dim // 2] f32; weight: [head_dim] f32."""
    n, heads, head_dim = x.shape
    half = head_dim // 2
    assert x.stride(2) == 1 and half == next_power_of_2(half)
    assert cos.shape == (n, half) and cos.is_contiguous() and sin.is_contiguous()
    assert weight.dtype == torch.float32 and cos.dtype == torch.float32
    out = empty((n, heads, head_dim), torch.float32, x.device)
    if n:
        launch(_qk_norm_rope_kernel, (n * heads,), x, weight, cos, sin, out, heads,
               x.stride(0), x.stride(1), cos.stride(0), eps, HALF=half, **options(x.device))
    return out


def qk_norm_rope_pair(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rope of q: [N, H, D] and k: [N, KVH, D] in one launch -> (q, k) float32."""
    n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    half = head_dim // 2
    assert q.stride(2) == 1 and k.stride(2) == 1 and k.shape == (n, kv_heads, head_dim)
    assert half == next_power_of_2(half) and cos.shape == (n, half)
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32
    q_out = empty((n, heads, head_dim), torch.float32, q.device)
    k_out = empty((n, kv_heads, head_dim), torch.float32, q.device)
    if n:
        launch(_qk_pair_kernel, (n * (heads + kv_heads),),
            q, k, q_weight, k_weight, cos, sin, q_out, k_out, heads, kv_heads, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps, HALF=half,
            **options(q.device))
    return q_out, k_out
