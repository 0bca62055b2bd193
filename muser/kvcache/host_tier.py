"""HostTier: what the prefix cache evicts from the device, kept in host memory within
--kv-host-gb, so that a later prompt gets it back by a copy instead of computing it again.

    page ......... a cached prefix page's rows in every full layer, under its prefix key
                   [full layers, 2, page_size, kv_heads, head_dim]: one block
    checkpoint ... a ring checkpoint (muser/kvcache/checkpoints.py) with its metadata
                   (muser/kvcache/prefix.py): one slot's rings [sliding layers, 2, ring
                   capacity, kv_heads, head_dim] as bytes over as many blocks as they need,
                   and one block for its partial page when it has a tail

The memory is one arena of blocks of a page's bytes, allocated once (on the CPU the system
commits it as it is written; with a GPU it is registered with CUDA, pinned, so the copies run
asynchronously in stream order): any free block holds any part, so entries of both kinds
never fragment it, and what it holds never exceeds the bound. An entry keeps the device copy's
bytes as they were, so copying it back restores the same KV bit for bit. One LRU over both
kinds: a new entry drops the least recently used ones until its blocks are free, and one larger
than the arena is not kept. An entry is in one tier at a time: a hit takes it off the LRU
(`take_*`), then copies it back (`*_back`), which frees its blocks.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch

from muser.errors import MuserError
from muser.kvcache.copy_meter import CopyMeter
from muser.kvcache.prefix import Checkpoint, HostTierStats, longest_tail

KINDS = ("page", "checkpoint")


class Held(NamedTuple):
    """An entry's blocks (in order) and, for a checkpoint, its metadata."""

    blocks: list[int]
    ckpt: Checkpoint | None


class HostTier:
    def __init__(self, capacity_bytes: int, page_shape: torch.Size, dtype: torch.dtype,
                 device: torch.device) -> None:
        """page_shape: one page of every full layer (a block's layout), in `dtype`; device:
        where the copies come from and go back to."""
        self.capacity_bytes, self.page_shape, self.dtype = capacity_bytes, page_shape, dtype
        self.device = device
        self.block_nbytes = page_shape.numel() * dtype.itemsize
        if capacity_bytes < self.block_nbytes:
            raise MuserError(f"--kv-host-gb holds no page: one takes {self.block_nbytes} bytes, "
                             f"the tier {capacity_bytes}")
        self.arena = torch.empty((capacity_bytes // self.block_nbytes, self.block_nbytes),
                                 dtype=torch.uint8)
        if device.type == "cuda":
            _register(self, self.arena)
        self.clear()

    def clear(self) -> None:
        """Drop every entry and zero the counters."""
        self._lru: OrderedDict[tuple, Held] = OrderedDict()  # least recently used first
        self._filed: dict[bytes, dict[tuple[int, ...], Checkpoint]] = {}
        self._free = list(range(self.arena.shape[0] - 1, -1, -1))
        self._held = dict.fromkeys(KINDS, 0)
        self.evictions = dict.fromkeys(KINDS, 0)
        self.meter = CopyMeter(self.device)

    @property
    def nbytes(self) -> int:
        """Bytes the entries' blocks take."""
        return (self.arena.shape[0] - len(self._free)) * self.block_nbytes

    def put_page(self, key: bytes, rows: torch.Tensor) -> None:
        """Keep a copy of an evicted page's rows (a device view of page_shape) under its key."""
        blocks = self._make_room(("page", key), 1)
        if blocks is not None:
            with self.meter.timed("to_host", self.block_nbytes):
                self._page(blocks[0]).copy_(rows, non_blocking=True)
            self._file(("page", key), Held(blocks, None))

    def put_checkpoint(self, ckpt: Checkpoint, rings: torch.Tensor,
                       tail: torch.Tensor | None) -> None:
        """Keep a copy of an evicted checkpoint's rows: `rings` (contiguous, on the device) and
        `tail`, its partial page (None when it has no tail)."""
        name = ("checkpoint", ckpt.key, ckpt.tail_ids)
        flat = rings.reshape(-1).view(torch.uint8)
        blocks = self._make_room(name, -(-flat.numel() // self.block_nbytes) + (tail is not None))
        if blocks is None:
            return
        with self.meter.timed("to_host", flat.numel() + (tail is not None) * self.block_nbytes):
            for block, part in zip(blocks, flat.split(self.block_nbytes)):
                self.arena[block, :part.numel()].copy_(part, non_blocking=True)
            if tail is not None:
                self._page(blocks[-1]).copy_(tail, non_blocking=True)
        self._file(name, Held(blocks, ckpt))

    def has_page(self, key: bytes) -> bool:
        return ("page", key) in self._lru

    def find(self, key: bytes, next_ids: list[int], max_tail: int) -> Checkpoint | None:
        """As CheckpointIndex.find, over the checkpoints held here (not touched)."""
        return longest_tail(self._filed.get(key, {}), next_ids, max_tail)

    def under(self, key: bytes) -> list[Checkpoint]:
        """The checkpoints held here filed under `key`."""
        return list(self._filed.get(key, {}).values())

    def take_page(self, key: bytes) -> Held:
        """Take a page off the LRU (no later entry drops it); `page_back` copies it back."""
        return self._unfile(("page", key))

    def take_checkpoint(self, ckpt: Checkpoint) -> Held:
        """Take a checkpoint off the LRU; `checkpoint_back` copies it back."""
        return self._unfile(("checkpoint", ckpt.key, ckpt.tail_ids))

    def page_back(self, held: Held, dst: torch.Tensor) -> None:
        """Device page view `dst` := the taken page's rows; its block is free again."""
        with self.meter.timed("to_device", self.block_nbytes):
            dst.copy_(self._page(held.blocks[0]), non_blocking=True)
        self._free.extend(held.blocks)

    def checkpoint_back(self, held: Held, rings: torch.Tensor,
                        tail: torch.Tensor | None) -> None:
        """Device store row `rings` (contiguous) and, when the checkpoint has a tail, page
        `tail` := the taken checkpoint's rows; its blocks are free again."""
        flat = rings.reshape(-1).view(torch.uint8)
        has_tail = bool(held.ckpt.tail_ids)
        with self.meter.timed("to_device", flat.numel() + has_tail * self.block_nbytes):
            for block, part in zip(held.blocks, flat.split(self.block_nbytes)):
                part.copy_(self.arena[block, :part.numel()], non_blocking=True)
            if has_tail:
                tail.copy_(self._page(held.blocks[-1]), non_blocking=True)
        self._free.extend(held.blocks)

    def forget_page(self, key: bytes) -> None:
        if ("page", key) in self._lru:
            self._free.extend(self._unfile(("page", key)).blocks)

    def forget_checkpoint(self, ckpt: Checkpoint) -> None:
        self._free.extend(self.take_checkpoint(ckpt).blocks)

    def stats(self) -> HostTierStats:
        return HostTierStats(self.capacity_bytes, self.nbytes, self._held["page"],
                             self._held["checkpoint"], dict(self.evictions),
                             dict(self.meter.bytes), self.meter.seconds())

    def _page(self, block: int) -> torch.Tensor:
        return self.arena[block].view(self.dtype).view(self.page_shape)

    def _make_room(self, name: tuple, num_blocks: int) -> list[int] | None:
        """`num_blocks` free blocks for a new entry `name`, the least recently used entries
        dropped for them -> the blocks, or None (held already, or larger than the arena)."""
        if name in self._lru:
            # NOTE: the same prefix computed again on the device: its rows are kept once
            self._lru.move_to_end(name)
            return None
        if num_blocks > self.arena.shape[0]:
            self.evictions[name[0]] += 1
            return None
        while len(self._free) < num_blocks and self._lru:
            oldest = next(iter(self._lru))
            self._free.extend(self._unfile(oldest).blocks)
            self.evictions[oldest[0]] += 1
        if len(self._free) < num_blocks:  # NOTE: the rest is taken, on its way back
            self.evictions[name[0]] += 1
            return None
        return [self._free.pop() for _ in range(num_blocks)]

    def _file(self, name: tuple, held: Held) -> None:
        self._lru[name] = held
        self._held[name[0]] += 1
        if held.ckpt is not None:
            self._filed.setdefault(held.ckpt.key, {})[held.ckpt.tail_ids] = held.ckpt

    def _unfile(self, name: tuple) -> Held:
        held = self._lru.pop(name)
        self._held[name[0]] -= 1
        if held.ckpt is not None:
            filed = self._filed[held.ckpt.key]
            del filed[held.ckpt.tail_ids]
            if not filed:
                del self._filed[held.ckpt.key]
        return held


def _register(owner: object, arena: torch.Tensor) -> None:
    """Pin `arena` for as long as `owner` lives. NOTE: registered rather than allocated pinned:
    torch's pinned allocator rounds each allocation up to a power of two."""
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(arena.data_ptr(), arena.nbytes, 0))
    if code != 0:
        raise RuntimeError(f"pinning {arena.nbytes} bytes of host memory for --kv-host-gb "
                           f"failed (CUDA error {code})")
    weakref.finalize(owner, _unregister, arena.data_ptr())


def _unregister(ptr: int) -> None:
    torch.cuda.synchronize()  # NOTE: no copy from or to the arena is still queued
    torch.cuda.cudart().cudaHostUnregister(ptr)
