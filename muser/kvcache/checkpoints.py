"""Device copies of ring checkpoints (muser/kvcache/prefix.py), allocated once.

Row i of the store holds one checkpoint:

    rings[i]  [sliding layers, 2, ring capacity, kv_heads, head_dim]   one slot's rings, physical
                                                                       rows as they were (the
                                                                       metadata restores them)
    tails[i]  [full layers, 2, page_size, kv_heads, head_dim]          the partial last page

Both live on the pool's device in the pool's dtype, so a restore is two copies.
"""

from __future__ import annotations

import torch

from muser.kvcache.pool import KVPool


def checkpoint_nbytes(pool: KVPool) -> int:
    """Bytes of one checkpoint: one slot's rings and one page."""
    return pool.rings[:, :, 0].nbytes + pool.page_nbytes


class CheckpointStore:
    def __init__(self, pool: KVPool, capacity: int) -> None:
        self.pool = pool
        ring, page = pool.rings[:, :, 0], pool.pages[:, :, 0]
        self.rings = torch.empty((capacity, *ring.shape), dtype=pool.dtype, device=ring.device)
        self.tails = torch.empty((capacity, *page.shape), dtype=pool.dtype, device=ring.device)

    @property
    def nbytes(self) -> int:
        return self.rings.nbytes + self.tails.nbytes

    def save(self, index: int, slot: int, tail_page: int | None) -> None:
        """Copy slot `slot`'s rings (and page `tail_page` of every full layer) into row index."""
        self.rings[index].copy_(self.pool.rings[:, :, slot])
        if tail_page is not None:
            self.tails[index].copy_(self.pool.pages[:, :, tail_page])

    def restore(self, index: int, slot: int, tail_page: int | None) -> None:
        """Copy row `index` back into slot `slot`'s rings (and into page `tail_page`)."""
        self.pool.rings[:, :, slot].copy_(self.rings[index])
        if tail_page is not None:
            self.pool.pages[:, :, tail_page].copy_(self.tails[index])
