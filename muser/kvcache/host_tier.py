"""HostTier: what the prefix cache evicts from the device, kept in host memory (pinned when the
device is a GPU) within --kv-host-gb, so that a later prompt gets it back by a copy instead of
computing it again.

    page ......... a cached prefix page's rows in every full layer, under its prefix key
                   [full layers, 2, page_size, kv_heads, head_dim]
    checkpoint ... a ring checkpoint's rows (muser/kvcache/checkpoints.py: one slot's rings
                   [sliding layers, 2, ring capacity, kv_heads, head_dim], and its partial page
                   when it has a tail) with its metadata (muser/kvcache/prefix.py)

An entry holds the device copy's bytes as they were (same dtype and layout), so copying it back
restores the same KV bit for bit. One LRU over both kinds: a new entry drops the least recently
used ones until it fits, and one larger than the whole tier is not kept. An entry is in one tier
at a time: a hit takes it off the host and back to the device (`take_page`, `take_checkpoint`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from muser.kvcache.copy_meter import CopyMeter
from muser.kvcache.prefix import Checkpoint, HostTierStats, longest_tail

KINDS = ("page", "checkpoint")


class _Entry(NamedTuple):
    tensors: tuple[torch.Tensor, ...]  # host copies
    ckpt: Checkpoint | None  # a checkpoint's metadata; None: a page


class HostTier:
    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        self.capacity_bytes = capacity_bytes
        self.device = device
        self.clear()

    def clear(self) -> None:
        """Drop every entry and zero the counters."""
        self._lru: OrderedDict[tuple, _Entry] = OrderedDict()  # least recently used first
        self._filed: dict[bytes, dict[tuple[int, ...], Checkpoint]] = {}
        self.nbytes = 0
        self._held = dict.fromkeys(KINDS, 0)
        self.evictions = dict.fromkeys(KINDS, 0)
        self.meter = CopyMeter(self.device)

    def put_page(self, key: bytes, rows: torch.Tensor) -> None:
        """Keep a copy of an evicted page's rows under its prefix key."""
        self._put(("page", key), (rows,), None)

    def put_checkpoint(self, ckpt: Checkpoint, rings: torch.Tensor,
                       tail: torch.Tensor | None) -> None:
        """Keep a copy of an evicted checkpoint's rows (`tail`: its partial page, None when it
        has no tail)."""
        self._put(("checkpoint", ckpt.key, ckpt.tail_ids),
                  (rings,) if tail is None else (rings, tail), ckpt)

    def has_page(self, key: bytes) -> bool:
        return ("page", key) in self._lru

    def find(self, key: bytes, next_ids: list[int], max_tail: int) -> Checkpoint | None:
        """As CheckpointIndex.find, over the checkpoints held here (not touched)."""
        return longest_tail(self._filed.get(key, {}), next_ids, max_tail)

    def under(self, key: bytes) -> list[Checkpoint]:
        """The checkpoints held here filed under `key`."""
        return list(self._filed.get(key, {}).values())

    def take_page(self, key: bytes) -> torch.Tensor:
        """The page's host rows, no longer held here (its caller copies them back)."""
        return self._pop(("page", key)).tensors[0]

    def take_checkpoint(self, ckpt: Checkpoint) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The checkpoint's host rings and tail page (None: no tail), no longer held here."""
        tensors = self._pop(("checkpoint", ckpt.key, ckpt.tail_ids)).tensors
        return tensors[0], tensors[1] if len(tensors) > 1 else None

    def forget_page(self, key: bytes) -> None:
        if ("page", key) in self._lru:
            self._pop(("page", key))

    def forget_checkpoint(self, ckpt: Checkpoint) -> None:
        self._pop(("checkpoint", ckpt.key, ckpt.tail_ids))

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Device tensor `dst` := host copy `src`, counted."""
        self.meter.copy("to_device", dst, src)

    def stats(self) -> HostTierStats:
        return HostTierStats(self.capacity_bytes, self.nbytes, self._held["page"],
                             self._held["checkpoint"], dict(self.evictions),
                             dict(self.meter.bytes), self.meter.seconds())

    def _put(self, name: tuple, src: tuple[torch.Tensor, ...], ckpt: Checkpoint | None) -> None:
        if name in self._lru:
            # NOTE: the same prefix computed again on the device: its rows are kept once
            self._lru.move_to_end(name)
            return
        nbytes = sum(t.nbytes for t in src)
        if nbytes > self.capacity_bytes:
            self.evictions[name[0]] += 1
            return
        while self.nbytes + nbytes > self.capacity_bytes:
            oldest = next(iter(self._lru))
            self._pop(oldest)
            self.evictions[oldest[0]] += 1
        pin = self.device.type == "cuda"
        copies = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in src)
        for copy, t in zip(copies, src):
            self.meter.copy("to_host", copy, t)
        self._lru[name] = _Entry(copies, ckpt)
        self.nbytes += nbytes
        self._held[name[0]] += 1
        if ckpt is not None:
            self._filed.setdefault(ckpt.key, {})[ckpt.tail_ids] = ckpt

    def _pop(self, name: tuple) -> _Entry:
        entry = self._lru.pop(name)
        self.nbytes -= sum(t.nbytes for t in entry.tensors)
        self._held[name[0]] -= 1
        if entry.ckpt is not None:
            filed = self._filed[entry.ckpt.key]
            del filed[entry.ckpt.tail_ids]
            if not filed:
                del self._filed[entry.ckpt.key]
        return entry
