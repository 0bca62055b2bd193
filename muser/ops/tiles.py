"""Tile classifier: which (query tile, key tile) pairs of a chunk are empty, partial or full.

Computed once per chunk and kind (the mask depends only on positions and the window), then
shared by every layer of that kind. Key k is visible to query q iff k <= q and q - k < window.
"""

from __future__ import annotations

import torch

EMPTY, PARTIAL, FULL = 0, 1, 2


def classify_tiles(
    q_start: int, num_q: int, k_start: int, num_k: int, window: int | None, tile_q: int, tile_k: int
) -> torch.Tensor:
    """-> int8 [ceil(num_q / tile_q), ceil(num_k / tile_k)] of EMPTY / PARTIAL / FULL."""
    qa = q_start + torch.arange(0, num_q, tile_q)
    qb = torch.clamp(qa + tile_q, max=q_start + num_q) - 1  # last query of each tile
    ka = k_start + torch.arange(0, num_k, tile_k)
    kb = torch.clamp(ka + tile_k, max=k_start + num_k) - 1  # last key of each tile
    qa, qb, ka, kb = qa[:, None], qb[:, None], ka[None, :], kb[None, :]
    any_visible = ka <= qb
    all_visible = kb <= qa
    if window is not None:
        any_visible &= (qa - kb) < window
        all_visible &= (qb - ka) < window
    tiles = torch.full(any_visible.shape, EMPTY, dtype=torch.int8)
    tiles[any_visible] = PARTIAL
    tiles[all_visible] = FULL
    return tiles
