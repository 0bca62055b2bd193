"""Page allocator for the growing caches of full-attention layers (host integers only)."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """The KV pool has no free page left."""


class PageAllocator:
    """Hands out page ids of a fixed pool; free + used == total at all times."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages, or raise OutOfPages and take none."""
        if count > len(self._free):
            raise OutOfPages(f"KV cache full: need {count} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, page_ids: list[int]) -> None:
        self._free.extend(reversed(page_ids))
