"""Tiled causal attention with online softmax, driven by the tile classifier (torch)."""

from __future__ import annotations

import torch

from muser.ops.dense_ref import visibility
from muser.ops.tiles import EMPTY, FULL


def attention_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    k_start: int,
    window: int | None,
    scale: float,
    tiles: torch.Tensor,
    tile_q: int,
    tile_k: int,
) -> torch.Tensor:
    """q: [T, H, D] at positions q_start.., k/v: [S, KVH, D] at k_start.. -> [T, H, D] f32.

    Empty tiles are never read; full tiles skip the mask; partial tiles apply it.
    """
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = (q.float() * scale).reshape(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    out = torch.empty(num_kv_heads, group, num_q, head_dim)
    for i in range(tiles.shape[0]):
        qs = slice(i * tile_q, min((i + 1) * tile_q, num_q))
        q_tile = qg[:, :, qs]
        m = torch.full(q_tile.shape[:-1], float("-inf"))
        l = torch.zeros(q_tile.shape[:-1])
        acc = torch.zeros(q_tile.shape)
        for j in torch.nonzero(tiles[i] != EMPTY).flatten().tolist():
            ks = slice(j * tile_k, min((j + 1) * tile_k, k.shape[0]))
            k_tile = k[ks].float().permute(1, 2, 0)[:, None]  # [KVH, 1, D, BK]
            v_tile = v[ks].float().permute(1, 0, 2)[:, None]  # [KVH, 1, BK, D]
            s = q_tile @ k_tile
            if tiles[i, j] != FULL:
                q_pos = torch.arange(q_start + qs.start, q_start + qs.stop)
                k_pos = torch.arange(k_start + ks.start, k_start + ks.stop)
                s = s.masked_fill(~visibility(q_pos, k_pos, window), float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            # NOTE: a row may see no key of a partial tile yet (window); keep exp() finite.
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v_tile
            m = m_new
        out[:, :, qs] = acc / l[..., None]
    return out.permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim)
