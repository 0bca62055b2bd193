"""The host tier on its own (CPU tensors): it gives back the bytes it was given, stays within its
bound by dropping the least recently used entries of either kind, and keeps what a hit has
taken until it is copied back."""

from __future__ import annotations

import torch

from muser.kvcache.host_tier import HostTier
from muser.kvcache.prefix import ROOT, Checkpoint
from muser.kvcache.ring import RingState

PAGE = torch.Size([2, 2, 4, 1, 8])  # [full layers, 2, page_size, kv_heads, head_dim]: a block
RINGS = torch.Size([3, 2, 10, 1, 8])  # one slot's rings: 3.75 blocks' bytes, so 4 blocks
BLOCK = PAGE.numel() * 4


def _rows(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _tier(num_blocks: int) -> HostTier:
    return HostTier(num_blocks * BLOCK + BLOCK // 2, PAGE, torch.float32, torch.device("cpu"))


def test_entries_come_back_bit_for_bit() -> None:
    tier = _tier(10)
    page = _rows(PAGE, 0)
    tier.put_page(b"k0", page[:, :, :])
    ckpt = Checkpoint(ROOT, (5, 6), 2, RingState(10), index=0)
    tier.put_checkpoint(ckpt, _rows(RINGS, 1), _rows(PAGE, 2))
    page.zero_()  # the device's rows are reused: the host keeps its own copy
    assert tier.has_page(b"k0") and tier.find(ROOT, [5, 6, 7], 9) == ckpt
    assert tier.find(ROOT, [5, 6, 7], 1) is None  # a tail longer than may be reused
    assert tier.nbytes == (1 + 4 + 1) * BLOCK
    back = torch.zeros(PAGE)
    tier.page_back(tier.take_page(b"k0"), back)
    rings, tail = torch.zeros(RINGS), torch.zeros(PAGE)
    tier.checkpoint_back(tier.take_checkpoint(ckpt), rings, tail)
    assert torch.equal(back, _rows(PAGE, 0)) and not tier.has_page(b"k0")
    assert torch.equal(rings, _rows(RINGS, 1)) and torch.equal(tail, _rows(PAGE, 2))
    s = tier.stats()
    assert (s.nbytes, s.pages, s.checkpoints) == (0, 0, 0) and s.capacity_bytes == 10.5 * BLOCK
    moved = 2 * BLOCK + RINGS.numel() * 4
    assert s.copied_bytes == {"to_host": moved, "to_device": moved}
    assert s.copy_seconds["to_host"] > 0 and s.copy_seconds["to_device"] > 0


def test_a_full_tier_drops_its_least_recently_used_entries_within_its_bound() -> None:
    """6 blocks. Pages 0..5 fill them; a checkpoint of 4 blocks drops the 4 oldest pages; page 4
    put again is touched (kept once), so one more page drops page 5; an entry larger than the
    tier is not kept; a page a hit took keeps its block until it is copied back."""
    tier = _tier(6)
    for i in range(6):
        tier.put_page(b"k%d" % i, _rows(PAGE, i))
    assert tier.nbytes == 6 * BLOCK <= tier.capacity_bytes
    ckpt = Checkpoint(ROOT, (1,), 1, RingState(10), index=3)
    tier.put_checkpoint(ckpt, _rows(RINGS, 9), None)
    assert [tier.has_page(b"k%d" % i) for i in range(6)] == [False] * 4 + [True] * 2
    tier.put_page(b"k4", _rows(PAGE, 4))
    tier.put_page(b"k6", _rows(PAGE, 6))
    assert [tier.has_page(b"k%d" % i) for i in (4, 5, 6)] == [True, False, True]
    assert tier.find(ROOT, [1], 5) == ckpt
    tier.put_checkpoint(Checkpoint(ROOT, (2,), 1, RingState(64), index=4),
                        torch.zeros(1, 2, 64, 1, 8), None)  # 8 blocks
    taken = tier.take_page(b"k4")
    for i in range(7, 12):  # k7 drops the checkpoint, k11 page 6
        tier.put_page(b"k%d" % i, _rows(PAGE, i))
        assert tier.nbytes <= tier.capacity_bytes
    s = tier.stats()
    assert s.nbytes == 6 * BLOCK and (s.pages, s.checkpoints) == (5, 0)
    assert s.evictions == {"page": 6, "checkpoint": 2}
    back = torch.zeros(PAGE)
    tier.page_back(taken, back)
    assert torch.equal(back, _rows(PAGE, 4)) and tier.nbytes == 5 * BLOCK
