"""Placement: where one sequence's KV lives, in host integers (no tensors here).

    slot ........ its row of the sliding layers' rings (None: not placed)
    ring ........ those rings' metadata (muser/kvcache/ring.py)
    num_cached .. rows of the sequence in the cache: positions [0, num_cached)
    page_ids .... the full layers' pages holding those rows, in order
    token_ids ... with the prefix cache: the ids of those rows, and `keys` the prefix key of
    keys          each full page (muser/kvcache/prefix.py)

The runner places, grows and frees it (muser/runner.py); the prefix cache restores and saves it
(muser/kvcache/reuse.py), at every CHECKPOINT_EVERY rows a chunk ends on and where its prompt
ends. The engine's Sequence is a Placement (muser/sequence.py), so these
counts have one owner: the scheduler reads the same `num_cached` the runner commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from muser.kvcache.ring import RingState


@dataclass(slots=True, eq=False, kw_only=True)
class Placement:
    slot: int | None = None
    ring: RingState | None = None
    num_cached: int = 0
    page_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

    @property
    def prompt_end(self) -> int | None:
        """Where its prompt ends (the prefix cache checkpoints it there); None: not known."""
        return None

    @property
    def is_placed(self) -> bool:
        """It holds a slot (and, from its first step on, the pages of its rows)."""
        return self.slot is not None
