"""Prefix keys and the index of ring checkpoints (host integers only).

A token prefix is named by a chain of keys, one per full page of `page_size` tokens:

    key[i] = blake2b(key[i - 1] + tokens[i * page_size : (i + 1) * page_size])    key[-1] = ROOT

so key[i] names the whole prefix tokens[:(i + 1) * page_size], and a page registered under it
(muser/kvcache/pages.py) holds that prefix's K/V rows of every full-attention layer.

A ring checkpoint restores a sequence at P tokens: every sliding layer's ring as it was at P
(rows and metadata) and, when P ends inside a page, the rows of that partial page. It is filed
under the key of the last full page before P, with the tokens after that page:

    tokens     [0 ............ k * page_size) [k * page_size .. P)     P = k * page_size + t
    from       k shared pages (key[k - 1])    the checkpoint's tail:   0 <= t < page_size
                                              copied into a new page

A prompt hits a checkpoint when its first P tokens are that prefix and the k pages are still
cached; the rest of the prompt is prefilled after P.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np

from muser.kvcache.ring import RingState

ROOT = b""


def chain_keys(token_ids: list[int], page_size: int, parent: bytes = ROOT) -> list[bytes]:
    """The keys of each full page of `token_ids`, chained from `parent` (the key before)."""
    full = len(token_ids) // page_size
    if not full:
        return []
    # NOTE: the ids converted in one call, then hashed page by page from a view: per-page
    # conversions and concatenations took 7 ms of a 131k-token prompt's host time, on the
    # request path before its first kernel (a prefix hit's TTFT)
    blocks = np.fromiter(token_ids, dtype=np.int64, count=full * page_size).reshape(full, -1)
    keys = []
    for block in blocks:
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(block)
        parent = h.digest()
        keys.append(parent)
    return keys


class Checkpoint(NamedTuple):
    key: bytes  # key of the last full page before num_tokens (ROOT: none)
    tail_ids: tuple[int, ...]  # the tokens after that page: num_tokens - k * page_size of them
    num_tokens: int
    ring: RingState  # every sliding layer's ring metadata at num_tokens
    index: int  # row of the checkpoint store holding the rows (a host copy's: the row it left)


T = TypeVar("T")


def longest_tail(filed: dict[tuple[int, ...], T], next_ids: list[int], max_tail: int) -> T | None:
    """Of checkpoints filed by tail, the one with the longest tail that begins `next_ids` and is
    at most `max_tail` long, or None."""
    best, best_len = None, -1
    for tail, ckpt in filed.items():
        n = len(tail)
        if best_len < n <= max_tail and list(tail) == next_ids[:n]:
            best, best_len = ckpt, n
    return best


class CheckpointIndex:
    """At most `capacity` checkpoints in two LRU segments. A checkpoint taken mid-prompt (at a
    chunk boundary) starts on probation; one taken where a prompt or a request ends, or found
    by a later prompt, is protected. A full index evicts the least recently used checkpoint on
    probation, and a protected one only when none is left there: a long prompt's chunk
    checkpoints never push out the ends of the conversations that will come back.

    spill: called with an evicted checkpoint before its store row is handed to another (the
    host tier copies the row there)."""

    def __init__(self, capacity: int, spill: Callable[[Checkpoint], None] | None = None) -> None:
        self.capacity = capacity
        self.spill = spill
        self._by_key: dict[bytes, dict[tuple[int, ...], Checkpoint]] = {}
        self._probation: OrderedDict[tuple[bytes, tuple[int, ...]], Checkpoint] = OrderedDict()
        self._protected: OrderedDict[tuple[bytes, tuple[int, ...]], Checkpoint] = OrderedDict()
        self._free_rows = list(range(capacity - 1, -1, -1))  # store rows no checkpoint holds
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def add(self, key: bytes, tail_ids: tuple[int, ...], num_tokens: int, ring: RingState,
            protected: bool = False) -> Checkpoint | None:
        """File a new checkpoint -> it (its `index`: the store row to fill), or None when it is
        held already (then it is touched, and protected if asked) or the capacity is 0."""
        known = self._by_key.get(key, {}).get(tail_ids)
        if known is not None:
            self._touch(known, protected)
            return None
        if not self.capacity:
            return None
        if not self._free_rows:
            old = next(iter((self._probation or self._protected).values()))
            self.remove(old.key, old.tail_ids)
            self.num_evictions += 1
            if self.spill is not None:
                self.spill(old)
        ckpt = Checkpoint(key, tail_ids, num_tokens, ring, self._free_rows.pop())
        self._by_key.setdefault(key, {})[tail_ids] = ckpt
        (self._protected if protected else self._probation)[(key, tail_ids)] = ckpt
        return ckpt

    def remove(self, key: bytes, tail_ids: tuple[int, ...]) -> None:
        """Drop the checkpoint filed under (key, tail_ids); its store row becomes free."""
        name = (key, tail_ids)
        ckpt = (self._probation if name in self._probation else self._protected).pop(name)
        del self._by_key[key][tail_ids]
        if not self._by_key[key]:
            del self._by_key[key]
        self._free_rows.append(ckpt.index)

    def under(self, key: bytes) -> list[Checkpoint]:
        """The checkpoints filed under `key` (not touched)."""
        return list(self._by_key.get(key, {}).values())

    def find(self, key: bytes, next_ids: list[int], max_tail: int,
             touch: bool = True) -> Checkpoint | None:
        """The longest checkpoint filed under `key` whose tail begins `next_ids` (the prompt's
        tokens after that page) and is at most `max_tail` long; when found and `touch`, it is
        touched and protected."""
        best = longest_tail(self._by_key.get(key, {}), next_ids, max_tail)
        if best is not None and touch:
            self.hit(best)
        return best

    def hit(self, ckpt: Checkpoint) -> None:
        """A later prompt found `ckpt`: touched and protected."""
        self._touch(ckpt, True)

    def _touch(self, ckpt: Checkpoint, protect: bool) -> None:
        name = (ckpt.key, ckpt.tail_ids)
        if name in self._probation and protect:
            self._protected[name] = self._probation.pop(name)
        else:
            (self._probation if name in self._probation else self._protected).move_to_end(name)


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """The host tier's counters since start (or since the last reset), for metrics."""

    capacity_bytes: int  # --kv-host-gb
    nbytes: int  # held now
    pages: int  # prefix pages held now
    checkpoints: int  # ring checkpoints held now
    evictions: dict[str, int]  # dropped to stay within capacity, per kind (page, checkpoint)
    copied_bytes: dict[str, int]  # per direction (to_host, to_device)
    copy_seconds: dict[str, float]  # per direction, as the device ran the copies


@dataclass(frozen=True, slots=True)
class PrefixStats:
    """Counters since start (or since the last reset), for metrics."""

    lookups: int  # prompts looked up
    hits: int  # prompts that started after a cached prefix (host_hits of them from the host)
    tokens_reused: int  # rows those prompts did not compute
    checkpoints: int  # checkpoints held now (at most capacity)
    capacity: int  # checkpoints the store holds (from --prefix-cache-gb)
    cached_pages: int  # pages no sequence holds, kept for their prefix
    page_evictions: int  # from the device (to the host tier, when there is one)
    checkpoint_evictions: int
    host_hits: int = 0  # hits that copied a page or their checkpoint back from the host tier
    host: HostTierStats | None = None  # None: no --kv-host-gb
