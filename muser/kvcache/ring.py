"""Placement metadata of a sliding-window ring: explicit logical and physical origins.

A ring of `capacity` rows holds the last `length` logical rows of a sequence:

    logical   : logical_origin, logical_origin + 1, ..., logical_origin + length - 1
    physical  : physical_origin, physical_origin + 1, ... (mod capacity)

Example, capacity 4, after 6 rows were appended (rows 2..5 retained):

    physical row     0   1   2   3
    logical row      4   5   2   3      logical_origin = 2, physical_origin = 2, length = 4

Every physical row comes from these three numbers; none is derived from an absolute
token position. All values are host integers; tensors never live here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RingState:
    capacity: int
    logical_origin: int = 0
    physical_origin: int = 0
    length: int = 0

    @property
    def logical_end(self) -> int:
        """One past the newest logical row held."""
        return self.logical_origin + self.length

    @property
    def is_contiguous(self) -> bool:
        """Logical row i sits at physical row i: the ring has never dropped a row."""
        return self.logical_origin == 0 and self.physical_origin == 0

    def can_append_in_place(self, num_rows: int) -> bool:
        """A chunk of `num_rows` fits after the held rows without wrapping."""
        return self.is_contiguous and self.length + num_rows <= self.capacity

    def tail(self, count: int) -> list[int]:
        """Physical rows of the newest `count` held rows, oldest first (logical order)."""
        count = min(count, self.length)
        first = self.length - count
        return [(self.physical_origin + first + i) % self.capacity for i in range(count)]

    def append(self, num_rows: int) -> tuple[RingState, list[tuple[int, int]]]:
        """Commit `num_rows` new rows -> (next state, [(new row index, physical row)]).

        Only the last `capacity` new rows are written; older ones would be overwritten anyway.
        """
        kept, first = self.writes(num_rows)
        return self.advance(num_rows), [
            (i, (first + j) % self.capacity) for j, i in enumerate(kept)]

    def writes(self, num_rows: int) -> tuple[range, int]:
        """Where `append(num_rows)` stores: (the new row indices kept, the physical row of the
        first of them; each next one follows it, mod capacity)."""
        first_kept = max(0, num_rows - self.capacity)
        return range(first_kept, num_rows), (
            self.physical_origin + self.length + first_kept) % self.capacity

    def retract(self) -> RingState:
        """The state with its newest row given back, to be computed again: the next append
        writes it where it was. The row left behind at the far end is not re-held, so the
        ring reads one row short of a full one until then; a window-wide read after that
        append needs none of the rows missing (capacity >= window)."""
        assert self.length, "an empty ring has no row to give back"
        return RingState(self.capacity, self.logical_origin, self.physical_origin,
                         self.length - 1)

    def advance(self, num_rows: int) -> RingState:
        """The state after `append(num_rows)`."""
        total = self.length + num_rows
        length = min(total, self.capacity)
        dropped = total - length
        return RingState(
            capacity=self.capacity,
            logical_origin=self.logical_origin + dropped,
            physical_origin=(self.physical_origin + dropped) % self.capacity,
            length=length,
        )
