"""Prefix sharing on host integers: page references, the cached LRU, prefix keys and the
checkpoint index."""

from __future__ import annotations

from muser.kvcache.pages import PageAllocator
from muser.kvcache.prefix import ROOT, CheckpointIndex, chain_keys
from muser.kvcache.ring import RingState


def _states(pages: PageAllocator, held: list[int]) -> tuple[int, int, int]:
    """(free, cached, held) counts; they always add up to the pool."""
    counts = (pages.num_free - pages.num_cached, pages.num_cached, len(set(held)))
    assert sum(counts) == pages.num_pages
    return counts


def test_shared_pages_are_cached_when_released_and_evicted_last_page_first() -> None:
    pages = PageAllocator(6)
    a = pages.allocate(3)
    keys = chain_keys(list(range(12)), 4)
    for page, key in zip(a, keys):
        pages.register(page, key)
    assert pages.lookup(keys) == a and pages.lookup(chain_keys(list(range(1, 13)), 4)) == []
    pages.share(a[:2])  # a second sequence begins with the first two pages
    assert pages.num_freed_by(a) == 1
    pages.free(a)
    assert _states(pages, a[:2]) == (3, 1, 2)
    pages.free(a[:2])
    assert _states(pages, []) == (3, 3, 0) and pages.lookup(keys) == a
    assert sorted(pages.allocate(4)) == sorted([3, 4, 5, a[2]])  # free first, then LRU
    assert pages.num_evictions == 1 and pages.lookup(keys) == a[:2]
    pages.share(a[:1])  # held again: not evictable
    assert pages.allocate(1) == [a[1]] and pages.num_free == 0
    assert pages.lookup(keys) == a[:1]


def test_forget_frees_cached_pages_and_keeps_held_ones() -> None:
    pages = PageAllocator(4)
    a = pages.allocate(2)
    for page, key in zip(a, chain_keys(list(range(8)), 4)):
        pages.register(page, key)
    pages.free(a[1:])
    pages.forget()
    assert _states(pages, a[:1]) == (3, 0, 1) and pages.lookup(chain_keys(list(range(8)), 4)) == []


def test_chain_keys_name_the_whole_prefix() -> None:
    ids = list(range(100))
    keys = chain_keys(ids, 16)
    assert len(keys) == 6 and len(set(keys)) == 6
    assert chain_keys(ids[32:64], 16, keys[1]) == keys[2:4]
    assert chain_keys([7] + ids[1:], 16)[0] != keys[0]


def test_checkpoint_index_finds_the_longest_matching_tail_and_evicts_lru() -> None:
    index = CheckpointIndex(2)
    ring = RingState(8)
    a = index.add(ROOT, (1, 2), 2, ring)
    b = index.add(ROOT, (1, 2, 3, 4), 4, ring)
    assert (a.index, b.index) == (0, 1) and index.add(ROOT, (1, 2), 2, ring) is None
    assert index.find(ROOT, [1, 2, 3, 4, 5], 9) is b
    assert index.find(ROOT, [1, 2, 3, 4, 5], 3) is a  # a prompt's last token is never reused
    assert index.find(ROOT, [1, 3], 9) is None and index.find(b"other", [1, 2], 9) is None
    c = index.add(ROOT, (9,), 1, ring)  # full: the least recently used one (b) goes
    assert c.index == b.index and index.num_evictions == 1
    assert index.find(ROOT, [1, 2, 3, 4], 9) is a and len(index) == 2
    assert CheckpointIndex(0).add(ROOT, (1,), 1, ring) is None


def test_chunk_checkpoints_never_push_out_a_request_end() -> None:
    """Checkpoints taken mid-prompt are evicted before those that end a request or were hit:
    a long prompt's many chunk checkpoints leave the other conversations' ends in place."""
    index = CheckpointIndex(3)
    ring = RingState(8)
    end_a = index.add(b"a", (1,), 1, ring, protected=True)
    end_b = index.add(b"b", (2,), 1, ring, protected=True)
    for i in range(5):  # one long prompt: a checkpoint at each chunk boundary
        index.add(b"c", tuple(range(i + 1)), i + 1, ring)
    assert index.find(b"a", [1, 5], 9) is end_a and index.find(b"b", [2, 5], 9) is end_b
    assert len(index) == 3 and index.num_evictions == 4  # chunk checkpoints replaced each other
    chunk = index.find(b"c", [0, 1, 2, 3, 4, 9], 9, touch=False)
    assert chunk.num_tokens == 5
    assert index.find(b"c", [0, 1, 2, 3, 4, 9], 9) is chunk  # hit: protected from now on
    index.add(b"d", (7,), 1, ring)  # all protected: the least recently used (end_a) goes
    assert index.find(b"a", [1, 5], 9) is None and index.find(b"c", [0, 1, 2, 3, 4], 9) is chunk


def test_removed_checkpoints_free_their_store_rows_and_unregistered_pages_their_keys() -> None:
    index, ring = CheckpointIndex(3), RingState(8)
    rows = {index.add(ROOT, (i,), 1, ring).index for i in range(3)}
    assert rows == {0, 1, 2}
    index.remove(ROOT, (1,))
    assert len(index) == 2 and index.find(ROOT, [1, 5], 4) is None
    again = index.add(ROOT, (7,), 1, ring)
    assert again.index == 1 and index.num_evictions == 0  # the freed row, no eviction
    evicting = index.add(ROOT, (9,), 1, ring)  # full: the least recently used (0,) goes
    assert evicting.index == 0 and index.num_evictions == 1
    assert {c.tail_ids for c in index.under(ROOT)} == {(2,), (7,), (9,)}
    pages = PageAllocator(3)
    a = pages.allocate(2)
    keys = chain_keys(list(range(8)), 4)
    for page, key in zip(a, keys):
        pages.register(page, key)
    pages.free(a[1:])  # a[1] cached, a[0] still held
    pages.unregister(keys[1])
    pages.unregister(keys[0])
    assert pages.lookup(keys) == [] and pages.num_cached == 0 and _states(pages, a[:1]) == (2, 0, 1)
    pages.free(a[:1])  # no longer registered: freed, not cached
    assert _states(pages, []) == (3, 0, 0)
