"""Dense masked attention: the fail-safe route, the decode reference and the test oracle."""

from __future__ import annotations

import torch


def visibility(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None
) -> torch.Tensor:
    """[num_q], [num_k] positions -> bool [num_q, num_k]: causal, and within the window."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    return visible


def attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
    scale: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [S, KVH, D] (logical order) -> [T, H, D] computed in `dtype`.

    Rows with no visible key (impossible for valid inputs) come out as zeros.
    """
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = q.to(dtype).reshape(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kg = k.to(dtype).permute(1, 2, 0)  # [KVH, D, S]
    vg = v.to(dtype).permute(1, 0, 2)  # [KVH, S, D]
    scores = (qg * scale) @ kg[:, None]  # [KVH, G, T, S]
    scores = scores.masked_fill(~visibility(q_pos, k_pos, window), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = probs @ vg[:, None]  # [KVH, G, T, D]
    return out.permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim)


def attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query row over every given key. q: [H, D], k/v: [S, KVH, D] -> [H, D] float32."""
    num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.float().reshape(num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = (qg * scale) @ k.float().permute(1, 2, 0)  # [KVH, G, S]
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v.float().transpose(0, 1)).reshape(num_heads, head_dim)
