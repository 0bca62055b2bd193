"""The host tier on its own (CPU tensors): it keeps the bytes it is given, stays within its
bound by dropping the least recently used entries of either kind, and gives an entry back once."""

from __future__ import annotations

import torch

from muser.kvcache.host_tier import HostTier
from muser.kvcache.prefix import ROOT, Checkpoint
from muser.kvcache.ring import RingState

PAGE = torch.Size([2, 2, 4, 1, 8])  # [full layers, 2, page_size, kv_heads, head_dim]
RINGS = torch.Size([2, 2, 16, 1, 8])  # one slot's rings: 4 pages' bytes


def _rows(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_entries_come_back_bit_for_bit_and_leave_the_tier() -> None:
    page = _rows(PAGE, 0)
    tier = HostTier(10 * page.nbytes, torch.device("cpu"))
    tier.put_page(b"k0", page)
    ckpt = Checkpoint(ROOT, (5, 6), 2, RingState(16), index=0)
    rings, tail = _rows(RINGS, 1), _rows(PAGE, 2)
    tier.put_checkpoint(ckpt, rings, tail)
    page.zero_()  # the device's rows are reused: the host keeps its own copy
    assert tier.has_page(b"k0") and tier.find(ROOT, [5, 6, 7], 9) == ckpt
    assert tier.find(ROOT, [5, 6, 7], 1) is None  # a tail longer than may be reused
    assert torch.equal(tier.take_page(b"k0"), _rows(PAGE, 0)) and not tier.has_page(b"k0")
    back_rings, back_tail = tier.take_checkpoint(ckpt)
    assert torch.equal(back_rings, rings) and torch.equal(back_tail, tail)
    s = tier.stats()
    assert (s.nbytes, s.pages, s.checkpoints) == (0, 0, 0)
    assert s.copied_bytes == {"to_host": 2 * page.nbytes + rings.nbytes, "to_device": 0}
    assert s.copy_seconds["to_host"] > 0


def test_a_full_tier_drops_its_least_recently_used_entries_within_its_bound() -> None:
    """Bound: 6 pages' bytes. Pages 0..5 fill it; a checkpoint of 4 pages' bytes drops the 4
    oldest pages, one more page the oldest left (page 4), a page kept twice is kept once, and an
    entry larger than the whole tier is not kept."""
    page_nbytes = _rows(PAGE, 0).nbytes
    tier = HostTier(6 * page_nbytes, torch.device("cpu"))
    for i in range(6):
        tier.put_page(b"k%d" % i, _rows(PAGE, i))
    assert tier.nbytes == tier.capacity_bytes
    ckpt = Checkpoint(ROOT, (1,), 1, RingState(16), index=3)
    tier.put_checkpoint(ckpt, _rows(RINGS, 9), None)
    assert [tier.has_page(b"k%d" % i) for i in range(6)] == [False] * 4 + [True] * 2
    tier.put_page(b"k6", _rows(PAGE, 6))
    assert not tier.has_page(b"k4") and tier.has_page(b"k5") and tier.has_page(b"k6")
    tier.put_page(b"k5", _rows(PAGE, 5))
    tier.put_checkpoint(Checkpoint(ROOT, (2,), 1, RingState(64), index=4),
                        torch.zeros(2, 2, 64, 1, 8), None)  # 16 pages' bytes
    s = tier.stats()
    assert s.nbytes == 6 * page_nbytes <= s.capacity_bytes and (s.pages, s.checkpoints) == (2, 1)
    assert s.evictions == {"page": 5, "checkpoint": 1}
    assert tier.find(ROOT, [1, 2], 5) == ckpt and tier.find(ROOT, [2], 5) is None
    assert s.copied_bytes["to_host"] == 7 * page_nbytes + _rows(RINGS, 0).nbytes
