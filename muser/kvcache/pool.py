"""KV tensors: a ring per sequence slot for sliding layers, a page pool for full layers, each
row in its kind's geometry (ModelConfig.kv_row). Only layers that own a cache have one: a
KV-sharing layer's views are its owner's (ModelConfig.kv_owner), no second copy. An FP8 cache
is uint8 with `row_pad` bytes after each head's codes: its scale (muser/ops/kv_fp8.py), in the
same rows, so every copy of pages, rings and slots carries it.

Layers never allocate; they get views of these tensors through `layer()`.
"""

from __future__ import annotations

import torch

from muser.config import ModelConfig


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        ring_capacity: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        row_pad: int = 0,
    ) -> None:
        self.ring_capacity = ring_capacity
        self.page_size = page_size
        self.dtype = dtype
        (rh, rd), (ph, pd) = cfg.kv_row("sliding"), cfg.kv_row("global")
        self._ring_row, self._page_row = (rh, rd + row_pad), (ph, pd + row_pad)
        sliding, full = cfg.cache_layers("sliding"), cfg.cache_layers("global")
        self._index = {layer_id: i for i, layer_id in enumerate(sliding)}
        self._index |= {layer_id: i for i, layer_id in enumerate(full)}
        self._index |= {layer_id: self._index[cfg.kv_owner(layer_id)]
                        for layer_id in range(cfg.num_layers)}
        self._kinds = cfg.layer_kinds
        self._num_full = len(full)
        ring_shape = (len(sliding), 2, num_slots, ring_capacity, *self._ring_row)
        self.rings = torch.zeros(ring_shape, dtype=dtype, device=device)
        self.allocate_pages(num_pages)

    def allocate_pages(self, num_pages: int) -> None:
        """(Re)make the full layers' pages, zeroed, releasing the old ones first.
        NOTE: CUDA graphs keep the addresses they were captured with: capture after this."""
        self.pages = self._rows = None
        shape = (self._num_full, 2, num_pages, self.page_size, *self._page_row)
        self.pages = torch.zeros(shape, dtype=self.dtype, device=self.rings.device)
        self._rows = [tuple(t.flatten(0, 1) for t in self.layer(i))
                      for i in range(len(self._kinds))]

    def copy_slot(self, src: int, dst: int, src_page: int | None, dst_page: int | None) -> None:
        """Slot `dst`'s rings := slot `src`'s (and page `dst_page` := page `src_page` in every
        full layer): a forked sequence's own copy of what it may overwrite."""
        self.rings[:, :, dst].copy_(self.rings[:, :, src])
        if src_page is not None:
            self.pages[:, :, dst_page].copy_(self.pages[:, :, src_page])

    def copy_page(self, src: int, dst: int) -> None:
        """Page `dst` := page `src` in every full layer."""
        self.pages[:, :, dst].copy_(self.pages[:, :, src])

    @property
    def num_pages(self) -> int:
        return self.pages.shape[2]

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page: K and V of page_size rows in every full layer."""
        rows = 2 * self._num_full * self.page_size * self._page_row[0] * self._page_row[1]
        return rows * self.rings.element_size()

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer (its owner's for a KV-sharing layer): [num_slots, capacity,
        kv_heads, head_dim] for sliding layers, [num_pages, page_size, kv_heads, head_dim] for
        full layers."""
        store = self.rings if self._kinds[layer_id] == "sliding" else self.pages
        kv = store[self._index[layer_id]]
        return kv[0], kv[1]

    def rows(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer as flat physical rows: [slots * capacity or pages * page_size,
        kv_heads, head_dim]."""
        return self._rows[layer_id]

    def nbytes(self) -> dict[str, int]:
        return {"kv_sliding": self.rings.nbytes, "kv_pages": self.pages.nbytes}
