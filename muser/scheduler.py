"""Decode-first continuous batching over host integers (no tensors here).

Each call to `schedule()` returns one forward step under a token budget:

    1. every decode-ready row (one row per sequence), always, first in the step, each with
       the drafts proposed for it (Sequence.drafts, speculative decoding) that fit in the
       step's rows and the free pages (the rest are dropped)
    2. then prefill rows of one or more prompts, oldest first, each at most `prefill_chunk`
       rows, all together at most
           `decode_waiting_chunk` while any row decodes (adaptive policy: a long prompt
                                  never stalls running streams), and
           `max_batched_tokens` minus the decode rows in any case

KV pages are counted here too: a row that starts a new page takes one from `free_pages`.
When the decode rows need more pages than are free, the newest running sequence is preempted
(its KV dropped; it waits at the head of the queue and is recomputed from its prompt and
outputs when pages free up). A prompt whose chunk finds no free page waits.

A request that will fork into n samples once prefilled (`num_forks` = n - 1) is admitted only
when that many more sequence places are free, and keeps them (its seats) until it forks.

A request admitted with a cached prefix (`num_cached` > 0 before its first step: the engine
places it between `admit()` and `schedule()`; the count is the sequence's own, committed by the
runner, muser/kvcache/placement.py) holds the pages of those rows already; pages shared
with other sequences are not given back by its preemption, so the engine's `preempt` hook
says how many are.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from muser.core import Status
from muser.sequence import Sequence

WORK_CLASSES = ("decode", "prefill")
STEP_KINDS = ("decode", "prefill", "mixed")


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


@dataclass(slots=True)
class Batch:
    """One step: `reqs[:num_decode]` bring one decode row each (those with drafts to verify
    last, the row and its drafts: num_tokens 1 + len(req.drafts)), the rest prefill rows."""

    reqs: list[Sequence]
    num_tokens: list[int]  # new rows per request
    num_decode: int
    # KV to drop before the step (already dropped when schedule() had a preempt hook)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def kind(self) -> str:
        if self.num_decode == len(self.reqs):
            return "decode"
        return "mixed" if self.num_decode else "prefill"

    @property
    def num_prefill_rows(self) -> int:
        return sum(self.num_tokens[self.num_decode:])


@dataclass(slots=True)
class SchedulerStats:
    """Counters for metrics since start: steps per kind, rows per work class, preemptions."""

    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WORK_CLASSES, 0))
    preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        prefill_chunk: int = 512,
        decode_waiting_chunk: int = 64,
        adaptive: bool = True,
        max_waiting: int | None = None,
        max_batched_tokens: int | None = None,
        page_size: int | None = None,
    ) -> None:
        """max_batched_tokens: rows per step (default: max_num_seqs + prefill_chunk); it must
        hold every decode row. page_size: rows per KV page, for page accounting (None: pages
        are not counted)."""
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.decode_waiting_chunk = decode_waiting_chunk
        self.adaptive = adaptive
        self.max_waiting = max_waiting
        self.max_batched_tokens = max_batched_tokens or max_num_seqs + prefill_chunk
        if self.max_batched_tokens < max_num_seqs:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must hold a decode "
                             f"row of every sequence (max_num_seqs = {max_num_seqs})")
        self.page_size = page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, req: Sequence, first: bool = False) -> None:
        """Queue a request (first: at the head of the queue, past its bound)."""
        if first:
            self.waiting.appendleft(req)
            return
        if self.is_full:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(req)

    @property
    def num_seats(self) -> int:
        """Sequence places taken: running requests and the forks they will make."""
        return len(self.running) + sum(r.num_forks for r in self.running)

    def release_seat(self, req: Sequence) -> None:
        """One of `req`'s forks is made (its seat goes to it, or back to the pool)."""
        req.num_forks -= 1

    def add_prefilled(self, req: Sequence) -> None:
        """A request whose prompt is in the cache already (prefilled elsewhere, or forked)
        joins the running sequences, its next row a decode row. The caller checks there is
        room."""
        if self.num_seats >= self.max_num_seqs:
            raise QueueFull(f"{self.max_num_seqs} sequences already running")
        req.status = Status.DECODE
        self.running.append(req)

    @property
    def is_full(self) -> bool:
        return self.max_waiting is not None and len(self.waiting) >= self.max_waiting

    def remove(self, uid: int) -> Sequence | None:
        """Drop a request wherever it is; returns it, or None if unknown."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.uid == uid:
                    queue.remove(req)
                    return req
        return None

    @property
    def decode_ready(self) -> list[Sequence]:
        return [r for r in self.running if r.status == Status.DECODE]

    @property
    def prefilling(self) -> list[Sequence]:
        return [r for r in self.running if r.status == Status.PREFILL]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queue_depth(self) -> dict[str, int]:
        """Requests waiting per work class: decode-ready rows; prompts not yet fully prefilled."""
        return {"decode": len(self.decode_ready),
                "prefill": len(self.waiting) + len(self.prefilling)}

    def schedule(self, free_pages: int | None = None,
                 preempt: Callable[[Sequence], int] | None = None) -> Batch | None:
        """The next step, or None when nothing is running or waiting. free_pages: KV pages
        free now (counted only with a page_size). preempt: called with each request as it is
        preempted, drops its KV -> the pages that gave back (default: none is called, and
        every page its cached rows fill counts as given back)."""
        self.admit()
        pages = _Pages(self.page_size, free_pages)
        preempted: list[Sequence] = []
        while True:
            decodes = self.decode_ready
            if decodes and not pages.take_all(decodes):
                self._preempt_newest(pages, preempted, preempt)
                continue
            room = self.max_batched_tokens - len(decodes)
            reqs, rows = list(decodes), [1] * len(decodes)
            drafting = [req for req in decodes if req.drafts]
            for req in drafting:  # NOTE: drafts only where their rows and pages fit
                req.drafts = req.drafts[:pages.fit_more(req, 1, min(len(req.drafts), room))]
                room -= len(req.drafts)
            if drafting:  # NOTE: after the plain decode rows, which attend as one batch
                reqs = [req for req in decodes if not req.drafts]
                drafting = [req for req in drafting if req.drafts]
                reqs += drafting
                rows = [1] * (len(reqs) - len(drafting)) + [1 + len(r.drafts) for r in drafting]
            if decodes and self.adaptive:
                room = min(room, self.decode_waiting_chunk)
            for req in self.prefilling:
                if room <= 0:
                    break
                n = pages.fit(req, min(req.num_pending, self.prefill_chunk, room,
                                       req.max_chunk or room))
                if n:
                    reqs.append(req)
                    rows.append(n)
                    room -= n
            if reqs or not self.running:
                break
            # NOTE: prompts hold every page and none can go on: the newest gives its pages back
            self._preempt_newest(pages, preempted, preempt)
        if not reqs:
            return None
        batch = Batch(reqs, rows, len(decodes), preempted)
        self.stats.steps[batch.kind] += 1
        self.stats.rows["decode"] += sum(rows[:batch.num_decode])
        self.stats.rows["prefill"] += batch.num_prefill_rows
        return batch

    def finish(self, req: Sequence) -> None:
        req.status = Status.FINISHED
        if req in self.running:
            self.running.remove(req)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into free sequence places, oldest first -> those admitted
        (schedule() admits too; a caller that places cached prefixes admits first). A request
        pinned to a slot (SamplingParams.slot) that a running one holds or is pinned to is
        passed over and keeps its place in line (llama-server defers it); any other request
        that does not fit stops the admissions."""
        admitted, passed = [], []
        taken = self.pinned_slots()
        while self.waiting and self.num_seats + 1 + self.waiting[0].num_forks <= (
                self.max_num_seqs):
            req = self.waiting.popleft()
            pin = req.sampling.slot
            if pin is not None and pin in taken:
                passed.append(req)
                continue
            taken.add(pin)
            req.status = Status.PREFILL
            self.running.append(req)
            admitted.append(req)
        self.waiting.extendleft(reversed(passed))
        return admitted

    def pinned_slots(self) -> set[int | None]:
        """The slots running requests hold, or are pinned to before they are placed."""
        return {r.slot if r.slot is not None else r.sampling.slot for r in self.running}

    def _preempt_newest(self, pages: _Pages, preempted: list[Sequence],
                        preempt: Callable[[Sequence], int] | None) -> None:
        """Drop the KV of the newest running sequence that holds pages (never the oldest
        one: the pool holds one full sequence, so the oldest always goes on); it waits first in
        line, to be recomputed."""
        holders = [r for r in self.running[1:] if r.num_cached]
        if not holders:
            raise RuntimeError("the KV page pool cannot hold the oldest sequence")
        req = holders[-1]
        preempted.append(req)
        pages.release(req, None if preempt is None else preempt(req))
        self.running.remove(req)
        req.num_cached, req.drafts = 0, []
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.stats.preemptions += 1


class _Pages:
    """Free KV pages within one schedule() call (unbounded without a page size)."""

    def __init__(self, page_size: int | None, free: int | None) -> None:
        self.page_size = page_size
        self.free = free if page_size is not None and free is not None else None

    def needed(self, req: Sequence, rows: int) -> int:
        ps = self.page_size
        return -(-(req.num_cached + rows) // ps) - -(-req.num_cached // ps)

    def take_all(self, reqs: list[Sequence]) -> bool:
        """Take a page for every decode row that starts one -> False (nothing taken) if the
        free pages do not cover them all."""
        if self.free is None:
            return True
        want = sum(self.needed(r, 1) for r in reqs)
        if want > self.free:
            return False
        self.free -= want
        return True

    def fit(self, req: Sequence, rows: int) -> int:
        """The most rows (<= rows) of `req` whose pages are free; those pages are taken."""
        if self.free is None:
            return rows
        room = (-(-req.num_cached // self.page_size) + self.free) * self.page_size
        rows = max(0, min(rows, room - req.num_cached))
        self.free -= self.needed(req, rows)
        return rows

    def fit_more(self, req: Sequence, have: int, rows: int) -> int:
        """The most rows (<= rows) of `req` after the `have` rows already counted whose pages
        are free; those pages are taken."""
        if self.free is None:
            return rows
        room = (-(-(req.num_cached + have) // self.page_size) + self.free) * self.page_size
        rows = max(0, min(rows, room - req.num_cached - have))
        self.free -= self.needed(req, have + rows) - self.needed(req, have)
        return rows

    def release(self, req: Sequence, num_pages: int | None) -> None:
        """Count the pages a preempted request gave back (None: every page its rows fill)."""
        if self.free is not None:
            self.free += -(-req.num_cached // self.page_size) if num_pages is None else num_pages
