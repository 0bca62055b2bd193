"""Ring placement metadata against a brute-force model of the logical sequence."""

from __future__ import annotations

import random

import pytest

from muser.kvcache.pages import OutOfPages, PageAllocator
from muser.kvcache.ring import RingState


def _replay(capacity: int, chunks: list[int]) -> None:
    """Apply chunks to a ring and to a plain dict {physical row: logical row}; compare."""
    ring, rows, total = RingState(capacity), {}, 0
    for n in chunks:
        ring, writes = ring.append(n)
        for i, physical in writes:
            rows[physical] = total + i
        total += n
        assert ring.length == min(total, capacity)
        assert ring.logical_end == total
        assert ring.logical_origin == total - ring.length
        held = [rows[p] for p in ring.tail(ring.length)]
        assert held == list(range(ring.logical_origin, total))
        assert [rows[p] for p in ring.tail(3)] == held[-3:]


@pytest.mark.parametrize("capacity", [1, 4, 7, 512])
def test_ring_tracks_logical_rows_through_wraps(capacity: int) -> None:
    rng = random.Random(capacity)
    _replay(capacity, [rng.choice([1, 1, 2, 3, capacity - 1 or 1, capacity, capacity + 5])
                       for _ in range(60)])


def test_contiguity_and_in_place_append() -> None:
    ring = RingState(8)
    assert ring.can_append_in_place(8) and not ring.can_append_in_place(9)
    ring, writes = ring.append(5)
    assert writes == [(i, i) for i in range(5)] and ring.is_contiguous
    assert ring.can_append_in_place(3) and not ring.can_append_in_place(4)
    ring, _ = ring.append(4)  # wraps: row 0 now holds logical row 8
    assert not ring.is_contiguous and not ring.can_append_in_place(1)
    assert (ring.logical_origin, ring.physical_origin, ring.length) == (1, 1, 8)


def test_chunk_longer_than_ring_writes_only_survivors() -> None:
    ring, writes = RingState(4).append(10)
    assert [i for i, _ in writes] == [6, 7, 8, 9]
    assert (ring.logical_origin, ring.length) == (6, 4)


def test_page_allocator_integrity() -> None:
    pages = PageAllocator(10)
    a, b = pages.allocate(4), pages.allocate(6)
    assert pages.num_free == 0 and sorted(a + b) == list(range(10))
    with pytest.raises(OutOfPages):
        pages.allocate(1)
    pages.free(a)
    assert pages.num_free == 4
    with pytest.raises(OutOfPages):
        pages.allocate(5)
    assert pages.num_free == 4  # a failed allocation takes nothing
