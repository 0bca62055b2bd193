"""KV tensors: a ring per sequence slot for sliding layers, a page pool for full layers.

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
    ) -> None:
        self.ring_capacity = ring_capacity
        self.page_size = page_size
        self.dtype = dtype
        row = (cfg.num_kv_heads, cfg.head_dim)
        sliding, full = cfg.layers_of("sliding"), cfg.layers_of("global")
        self._index = {layer_id: i for i, layer_id in enumerate(sliding)}
        self._index |= {layer_id: i for i, layer_id in enumerate(full)}
        self._kinds = cfg.layer_kinds
        ring_shape = (len(sliding), 2, num_slots, ring_capacity, *row)
        page_shape = (len(full), 2, num_pages, page_size, *row)
        self.rings = torch.zeros(ring_shape, dtype=dtype, device=device)
        self.pages = torch.zeros(page_shape, dtype=dtype, device=device)
        self._rows = [tuple(t.flatten(0, 1) for t in self.layer(i))
                      for i in range(cfg.num_layers)]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer: [num_slots, capacity, kv_heads, head_dim] for sliding layers,
        [num_pages, page_size, kv_heads, head_dim] for full layers."""
        store = self.rings if self._kinds[layer_id] == "sliding" else self.pages
        kv = store[self._index[layer_id]]
        return kv[0], kv[1]

    def rows(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer as flat physical rows: [slots * capacity or pages * page_size,
        kv_heads, head_dim]."""
        return self._rows[layer_id]

    def nbytes(self) -> dict[str, int]:
        return {"kv_sliding": self.rings.nbytes, "kv_global": self.pages.nbytes}
