"""EngineLoop: one thread owns the engine; other threads submit and abort through a locked inbox.

It runs in the engine process (muser/server/engine_child.py); the server reads its LoopStats.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

from muser.core import SamplingParams, StepOutput
from muser.engine import Engine
from muser.scheduler import QueueFull
from muser.sequence import Sequence
from muser.server.loop_stats import LoopStats

log = logging.getLogger("muser.server")

Sink = Callable[[StepOutput], None]


class EngineLoop:
    def __init__(self, engine: Engine, max_queue: int | None = None) -> None:
        """max_queue: most requests waiting for a sequence slot before submit raises QueueFull."""
        self.engine, self.max_queue = engine, max_queue
        self.stats = LoopStats()
        self._cond = threading.Condition()
        self._inbox: list[tuple[Sequence, Sink]] = []
        self._aborts: list[int] = []
        self._calls: list[tuple[Callable[[Engine], object], Callable[[object], None]]] = []
        self._sinks: dict[int, Sink] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="muser-engine", daemon=True)
        engine.wake = self._wake  # NOTE: a remote prefill that arrives ends the wait for work

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def start(self) -> None:
        self._snapshot()
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel whatever is still in flight and join the thread (logged if it is still
        running after `timeout_s`, e.g. inside a step that does not return)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the engine loop did not stop within %.0f s", timeout_s)

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, sink: Sink,
               uid: int | None = None, checked: bool = False) -> int:
        """Queue a request -> its uid (`uid`, or the engine's next); `sink` is called from the
        loop thread with each StepOutput. Raises PromptError (unless `checked`: the caller ran
        muser.core.check_prompt), or QueueFull when the waiting queue is at its bound."""
        req = self.engine.make_request(prompt_ids, sampling, uid, checked=checked)
        bound = self.max_queue
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if bound is not None and len(self._inbox) + len(self.engine.scheduler.waiting) >= bound:
                raise QueueFull(f"{bound} requests already waiting")
            self._inbox.append((req, sink))
            self._cond.notify()
        return req.uid

    def abort(self, uid: int) -> None:
        """Cancel a request; its sequence and KV are freed before the next step."""
        with self._cond:
            self._aborts.append(uid)
            self._cond.notify()

    def call(self, fn: Callable[[Engine], object], reply: Callable[[object], None]) -> None:
        """Run fn(engine) on the loop thread between two steps (after the aborts that came
        before it) and pass reply its result, or the exception it raised."""
        with self._cond:
            self._calls.append((fn, reply))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._aborts or self._calls or self._stopping
                           or self.engine.has_work):
                    self._cond.wait()
                if self._stopping:
                    break
                adds, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
            for req, sink in adds:
                self.engine.add(req)
                self._sinks[req.uid] = sink
            for uid in aborts:
                self._deliver(self.engine.abort(uid))
            for fn, reply in calls:
                try:
                    result = fn(self.engine)
                except Exception as exc:  # noqa: BLE001  (the caller's to judge)
                    result = exc
                reply(result)
            if aborts or calls:
                self._snapshot()
            self._step()
        for uid in list(self.engine.live):
            self._deliver(self.engine.abort(uid))
        for req, sink in self._inbox:
            sink(StepOutput(req.uid, None, "", True, "cancelled"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing every request in flight")
            outputs = [self.engine.abort(uid) for uid in list(self.engine.live)]
            outputs = [StepOutput(o.uid, None, "", True, "error") for o in outputs if o]
        for out in outputs:
            self._deliver(out)
        self._snapshot()

    def _deliver(self, out: StepOutput | None) -> None:
        if out is None:
            return
        sink = (self._sinks.pop(out.uid, None) if out.finished and out.ends_request
                else self._sinks.get(out.uid))
        if sink is not None:
            try:
                sink(out)
            except Exception:
                log.exception("dropping output for request %d", out.uid)

    def _snapshot(self) -> None:
        sched, runner = self.engine.scheduler, self.engine.runner
        self.stats = LoopStats(sched.queue_depth(), dict(sched.stats.steps),
                               dict(sched.stats.rows),
                               tuple(self.engine.slots()),
                               len(runner.free_slots), runner.pages.num_free, runner.memory,
                               sched.stats.preemptions,
                               runner.prefix.stats() if runner.prefix is not None else None,
                               self.engine.remote.stats() if self.engine.remote else None,
                               spec.stats.copy() if (spec := self.engine.speculation) else None,
                               {s: len(ids) for s, ids in self.engine.slot_ids.items()},
                               dict(Counter(r.sampling.slot for r in sched.waiting
                                            if r.sampling.slot is not None)))
