"""Generation: one request's StepOutputs (of each of its n samples) as an async iterator;
leaving early aborts it."""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from muser.core import SamplingParams, StepOutput
from muser.server.engine_process import EngineProcess
from muser.server.metrics import Metrics

_DISCONNECT_POLL_S = 0.25


class Mailbox:
    """Outputs handed from the engine thread to one asyncio loop: the first output after a
    drain wakes the loop, the rest of the step's outputs ride along (one wake-up per step, not
    one per stream and token)."""

    def __init__(self, aloop: asyncio.AbstractEventLoop) -> None:
        self.aloop = aloop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, StepOutput]] = []

    def post(self, queue: asyncio.Queue, out: StepOutput) -> None:
        with self._lock:
            self._pending.append((queue, out))
            wake = len(self._pending) == 1
        if wake:
            self.aloop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for queue, out in items:
            queue.put_nowait(out)


_MAILBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mailbox(aloop: asyncio.AbstractEventLoop) -> Mailbox:
    box = _MAILBOXES.get(aloop)
    if box is None:
        box = _MAILBOXES[aloop] = Mailbox(aloop)
    return box


@dataclass(slots=True)
class Result:
    text: str  # sample 0's
    num_output: int  # tokens of every sample
    finish_reason: str
    outputs: list[StepOutput]  # every output, of every sample, in order


def samples(outputs: list[StepOutput], n: int) -> list[list[StepOutput]]:
    """A request's outputs -> each sample's, by index."""
    by_index: list[list[StepOutput]] = [[] for _ in range(n)]
    for out in outputs:
        by_index[out.index].append(out)
    return by_index


class Generation:
    def __init__(self, loop: EngineProcess, metrics: Metrics, prompt_ids: list[int],
                 sampling: SamplingParams) -> None:
        """Submits at once (the prompt checked by the caller); raises QueueFull or EngineDead."""
        self.loop, self.metrics = loop, metrics
        self.num_prompt = len(prompt_ids)
        self.n = sampling.n
        self.is_embedding = sampling.embed is not None  # its output is no token: no TTFT
        self.num_output = 0  # tokens of every sample
        self.num_cached = 0  # prompt tokens found in the prefix cache
        self.finish_reason: str | None = None  # set when the request (every sample) ends
        self.error: str | None = None  # with "error": the engine's words for the client
        self.reasons: dict[int, str] = {}  # each finished sample's
        self._drafts: dict[int, tuple[int, int]] = {}  # each sample's (drafted, accepted)
        self.last: StepOutput | None = None
        # prompt progress (SamplingParams.progress): rows in the cache at the last report, and
        # when the first and the last report came
        self.num_processed = 0
        self._progress_s: tuple[float, float] | None = None
        self._queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        box = mailbox(asyncio.get_running_loop())
        self._start = self._last = time.perf_counter()
        self._first: float | None = None
        self.uid = loop.submit(prompt_ids, sampling, lambda out: box.post(self._queue, out))
        metrics.tokens_in.inc(self.num_prompt)

    async def outputs(self) -> AsyncIterator[StepOutput]:
        """Every output until the finishing one (one sample's "error" or "cancelled" finishes
        the request); leaving early aborts the request."""
        try:
            while self.finish_reason is None:
                out = await self._queue.get()
                self._account(out)
                yield out
        finally:
            self.close()

    async def collect(self, http: HttpRequest) -> Result:
        """Wait for the whole text; abort if the client goes away meanwhile."""
        parts, outputs = [], []
        next_check = time.monotonic() + _DISCONNECT_POLL_S
        try:
            while self.finish_reason is None:
                try:
                    out = await asyncio.wait_for(self._queue.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    out = None
                if out is not None and out.progress is None:
                    self._account(out)
                    outputs.append(out)
                    if out.index == 0:
                        parts.append(out.text_delta)
                if time.monotonic() >= next_check:
                    if await http.is_disconnected():
                        break
                    next_check = time.monotonic() + _DISCONNECT_POLL_S
        finally:
            self.close()
        return Result("".join(parts), self.num_output, self.finish_reason or "cancelled", outputs)

    @property
    def num_drafted(self) -> int:
        """Draft tokens speculative decoding verified for it (every sample's)."""
        return sum(d for d, _ in self._drafts.values())

    @property
    def num_accepted(self) -> int:
        """Of those, the ones accepted (outputs that came from a draft)."""
        return sum(a for _, a in self._drafts.values())

    def timings(self) -> dict[str, float]:
        """llama.cpp-style timings: prompt (to the first token) and generation, in ms; while
        the prompt prefills with progress reports, the rows processed so far and the time since
        the first report."""
        if self._first is None and self._progress_s is not None:
            start, last = self._progress_s
            return {"prompt_n": self.num_processed, "prompt_ms": (last - start) * 1e3,
                    "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_second": 0.0}
        first = self._first or self._last
        prompt_ms = (first - self._start) * 1e3
        gen_ms = (self._last - first) * 1e3
        per_s = (self.num_output - 1) / gen_ms * 1e3 if gen_ms > 0 else 0.0
        return {"prompt_n": self.num_prompt, "prompt_ms": prompt_ms,
                "predicted_n": self.num_output, "predicted_ms": gen_ms,
                "predicted_per_second": per_s}

    def record_finished(self) -> None:
        """This generation's phases into the llamacpp: metric families (once, when done)."""
        t = self.timings()
        self.metrics.observe_finished(t["prompt_ms"], t["predicted_ms"],
                                      self.num_prompt + self.num_output,
                                      self.num_prompt - self.num_cached, self.num_cached,
                                      self.num_output)

    def close(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "cancelled"
            self.loop.abort(self.uid)

    def prompt_progress(self) -> dict[str, Any]:
        """llama-server's prompt_progress at the last report: total, cache, processed, time_ms
        (since the first report, when the prompt was placed)."""
        first, last = self._progress_s or (self._start, self._start)
        return {"total": self.num_prompt, "cache": self.num_cached,
                "processed": self.num_processed, "time_ms": round((last - first) * 1e3)}

    def _account(self, out: StepOutput) -> None:
        now = time.perf_counter()
        if out.progress is not None:
            self.num_cached, self.num_processed = out.num_reused, out.progress
            self._progress_s = (self._progress_s[0] if self._progress_s else now, now)
            return
        self.last = out
        self.num_cached = max(self.num_cached, out.num_reused)
        self._drafts[out.index] = max(self._drafts.get(out.index, (0, 0)),
                                      (out.num_drafted, out.num_accepted))
        if self._first is None and out.finish_reason not in ("cancelled", "error"):
            self._first = now
            if not self.is_embedding:
                self.metrics.ttft.observe(now - self._start)
        if out.token_id is not None:
            self.num_output += 1
            self.metrics.tokens_out.inc()
            self._last = now
        if out.finished:
            self.reasons[out.index] = out.finish_reason
        if out.finished and (out.ends_request or out.finish_reason in ("cancelled", "error")):
            self.finish_reason, self.error = out.finish_reason, out.error
            if not out.ends_request:  # NOTE: one sample failed: the others are not wanted
                self.loop.abort(self.uid)
            if self._first is not None and self.num_output > 1:
                self.metrics.tpot.observe((self._last - self._first) / (self.num_output - 1))


class GenerationStream(StreamingResponse):
    """Server-sent events of one Generation; the request is aborted however the response ends,
    even when the client leaves before the first event."""

    def __init__(self, gen: Generation, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()
