"""Decode-first continuous batching over host integers (no tensors here).

Each call to `schedule()` returns the next unit of work, of one of two work classes:

    decode-ready rows exist and the last batch was a prefill chunk (or nothing to prefill)
        -> DECODE: one pass over every decode-ready row
    a prompt is being prefilled
        -> PREFILL: its next chunk of `prefill_chunk` rows, or `decode_waiting_chunk` rows while
           any decode is waiting (adaptive), so a long prompt never stalls running streams
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from muser.core import Request, Status

WORK_CLASSES = ("decode", "prefill")


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


@dataclass(slots=True)
class Batch:
    is_prefill: bool
    reqs: list[Request]
    num_tokens: list[int]  # new rows per request, filled by the scheduler

    @property
    def work_class(self) -> str:
        return "prefill" if self.is_prefill else "decode"


@dataclass(slots=True)
class SchedulerStats:
    """Counters for metrics: steps and rows scheduled per work class since start."""

    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WORK_CLASSES, 0))
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WORK_CLASSES, 0))


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        prefill_chunk: int = 512,
        decode_waiting_chunk: int = 64,
        adaptive: bool = True,
        max_waiting: int | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.decode_waiting_chunk = decode_waiting_chunk
        self.adaptive = adaptive
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._last_was_prefill = False

    def add(self, req: Request) -> None:
        if self.is_full:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(req)

    @property
    def is_full(self) -> bool:
        return self.max_waiting is not None and len(self.waiting) >= self.max_waiting

    def remove(self, uid: int) -> Request | None:
        """Drop a request wherever it is; returns it, or None if unknown."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.uid == uid:
                    queue.remove(req)
                    return req
        return None

    @property
    def decode_ready(self) -> list[Request]:
        return [r for r in self.running if r.status == Status.DECODE]

    @property
    def prefilling(self) -> list[Request]:
        return [r for r in self.running if r.status == Status.PREFILL]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queue_depth(self) -> dict[str, int]:
        """Requests waiting per work class: decode-ready rows; prompts not yet fully prefilled."""
        return {"decode": len(self.decode_ready),
                "prefill": len(self.waiting) + len(self.prefilling)}

    def schedule(self) -> Batch | None:
        self._admit()
        decodes, prefills = self.decode_ready, self.prefilling
        if decodes and (self._last_was_prefill or not prefills):
            batch = Batch(False, decodes, [1] * len(decodes))
        elif prefills:
            req = prefills[0]
            width = self.decode_waiting_chunk if self.adaptive and decodes else self.prefill_chunk
            batch = Batch(True, [req], [min(width, req.num_prefill_left)])
        else:
            return None
        self._last_was_prefill = batch.is_prefill
        self.stats.steps[batch.work_class] += 1
        self.stats.rows[batch.work_class] += sum(batch.num_tokens)
        return batch

    def finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        if req in self.running:
            self.running.remove(req)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            req.status = Status.PREFILL
            self.running.append(req)
