"""Page allocator for the growing caches of full-attention layers, with pages shared by token
prefix (host integers only).

A page is in one of three states:

    free ..... on the free list
    held ..... reference count >= 1: in the page table of that many sequences (read-only
               once full: a sequence only appends, so a full page never changes)
    cached ... reference count 0, still registered under the key of the token prefix it
               ends (muser/kvcache/prefix.py): kept for a later prompt that begins with that
               prefix, in LRU order; evicted (unregistered, handed out) only when the free
               list is empty

`num_free` counts free and cached pages: both can be handed out now. A cached page evicted
is first given to `spill` when one is set (the prefix cache's host tier copies its rows out).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class OutOfPages(RuntimeError):
    """The KV pool has no free page left."""


class PageAllocator:
    """Hands out page ids of a fixed pool; free + cached + held == total at all times."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._page_of: dict[bytes, int] = {}  # prefix key -> page
        self._key_of: dict[int, bytes] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # reference count 0, LRU first
        self.num_evictions = 0
        self.spill: Callable[[int, bytes], None] | None = None  # (page, its key) on eviction

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Pages no sequence holds, kept for their prefix."""
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages (free ones first, then the least recently used cached ones), or
        raise OutOfPages and take none."""
        if count > self.num_free:
            raise OutOfPages(f"KV cache full: need {count} pages, {self.num_free} free")
        page_ids = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page = self._cached.popitem(last=False)[0]
                key = self._key_of.pop(page)
                del self._page_of[key]
                self.num_evictions += 1
                if self.spill is not None:
                    self.spill(page, key)
            self._refs[page] = 1
            page_ids.append(page)
        return page_ids

    def free(self, page_ids: list[int]) -> None:
        """Drop one reference to each page; a registered page no sequence holds is cached,
        the sequence's last pages first in line for eviction (its first ones are the prefix
        most prompts share)."""
        for page in reversed(page_ids):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self._key_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    def register(self, page_id: int, key: bytes) -> None:
        """Mark a full page as holding the prefix `key` (first page registered per key wins)."""
        if key not in self._page_of and page_id not in self._key_of:
            self._page_of[key] = page_id
            self._key_of[page_id] = key

    def unregister(self, key: bytes) -> None:
        """Forget the page registered under `key`, if any: a cached one becomes free, a held
        one stays held (and is freed, not cached, when its last holder lets go)."""
        page = self._page_of.pop(key, None)
        if page is None:
            return
        del self._key_of[page]
        if page in self._cached:
            del self._cached[page]
            self._free.append(page)

    def page_of(self, key: bytes) -> int | None:
        """The page registered under `key`, or None."""
        return self._page_of.get(key)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest run keys[:n] registered, in order."""
        page_ids = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            page_ids.append(page)
        return page_ids

    def share(self, page_ids: list[int]) -> None:
        """Take one more reference to each (registered) page."""
        for page in page_ids:
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1

    def forget(self) -> None:
        """Unregister every page: cached ones become free, held ones stay held."""
        self._free.extend(reversed(self._cached))
        self._cached.clear()
        self._page_of.clear()
        self._key_of.clear()

    def num_freed_by(self, page_ids: list[int]) -> int:
        """Pages that `free(page_ids)` would make free or cached (no other holder)."""
        return sum(self._refs[p] == 1 for p in page_ids)
