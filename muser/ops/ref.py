"""The specification of every op, in plain PyTorch: the CPU path and the test oracle.

Each function here has a twin with the same signature under `muser/ops/triton/`.
Activations on the residual stream are float32; projections take the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [N, K] float32, weight: [M, K] -> [N, M] float32; the product runs in weight.dtype."""
    return F.linear(x.to(weight.dtype), weight).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] -> same shape, float32. Gemma's (1 + w) is already folded into `weight`."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def add_rms_norm(
    residual: torch.Tensor,
    x: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + rms_norm(x, post) -> (new residual, rms_norm(new residual, next)); [N, D] f32."""
    residual = residual + rms_norm(x, post_weight, eps)
    return residual, rms_norm(residual, next_weight, eps)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [N] int -> (cos, sin): [N, head_dim // 2] float32, HF's inv_freq arithmetic."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponent / head_dim)) / scaling
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """x: [N, heads, head_dim] -> per-head RMSNorm then NeoX-style RoPE (rotate halves), f32."""
    x = rms_norm(x, weight, eps)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2 * I] (gate first) -> gelu_tanh(gate) * up: [N, I] float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
