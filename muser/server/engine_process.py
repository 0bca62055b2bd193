"""EngineProcess: the engine loop runs in a child process; the server process speaks HTTP.

In one process the event loop (HTTP parsing, JSON, the SSE chunks of every stream) and the
engine loop (scheduling, kernel launches, sampling) share one GIL: each waits for the other
between its steps, and under load the engine launches late. Here the child owns the model and
the EngineLoop; the server keeps the tokenizer and talks to the child over two pipes:

    server -> child   ("add", uid, prompt_ids, sampling) | ("abort", uid) | ("stop",)
                      | ("slot", call_id, action, slot, filename)
    child -> server   ("ready", Ready) | ("failed", message) once, then per engine step
                      ("step", [(uid, token_id, text_delta, finished, finish_reason,
                      num_reused, logprobs, prompt_logprobs, index, ends_request,
                      error, num_drafted, num_accepted, progress, embedding)...],
                      LoopStats | (steps per kind, rows per work class, preemptions))
                      and for each slot call ("slot", call_id, ("ok", answer) |
                      ("error", status, message, code))  (muser/slot_actions.py)

Outputs travel as plain tuples (a few us to pickle per step; logprobs as nested tuples of floats
and ids, only for requests that ask), and so do the step counters, every
step; the whole LoopStats snapshot (slots, pages...) rides along when a request produced its
first output, finished or left, and otherwise at most every STATS_INTERVAL_S. The child ignores
SIGINT (the server decides when it stops) and exits when its pipe from the server closes, so it
never outlives a killed server. If the child dies, every request in flight ends with "error",
new requests are refused with 503 and /health reports it.

This module is the server's side and never imports the engine (nor torch): the child's side is
muser/server/engine_child.py, imported only in the child (_child_entry); what both read is in
muser/server/engine_spec.py and muser/server/loop_stats.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection

from muser.core import SamplingParams, StepOutput
from muser.errors import MuserError
from muser.scheduler import QueueFull
from muser.server.engine_spec import EngineSpec, Ready
from muser.server.loop_stats import LoopStats

__all__ = ["EngineDead", "EngineProcess", "EngineSpec", "Ready"]

log = logging.getLogger("muser.server")

STOP_S, EXIT_S = 60, 10  # stop(): waits for the child's "stopped", then for its exit
Sink = Callable[[StepOutput], None]


class EngineDead(MuserError):
    """The engine process has exited; nothing more can be served."""


class EngineProcess:
    """The server's side: submit / abort / stats / stop, as an in-process EngineLoop offers."""

    def __init__(self, spec: EngineSpec, max_queue: int | None) -> None:
        """max_queue: most requests waiting beyond max_num_seqs before submit raises QueueFull."""
        self.spec, self.max_queue = spec, max_queue
        self.stats = LoopStats()
        self.ready: Ready | None = None
        self.error: str | None = None  # why the engine process is gone, once it is
        self.asleep = False  # stopped by sleep(), until wake() starts a fresh one
        self._sinks: dict[int, Sink] = {}
        self._calls: dict[int, Future] = {}  # slot actions waiting for the child's answer
        self._lock = threading.Lock()  # sinks, error and the pipe to the child
        self._uids = itertools.count()
        self._proc: mp.process.BaseProcess | None = None
        self._to_child: Connection | None = None
        self._from_child: Connection | None = None
        self._stopped = threading.Event()  # the child said it stopped
        self._reader: threading.Thread | None = None

    def launch(self) -> Ready:
        """Start the child and wait until its engine is loaded and warmed up -> Ready.
        Raises MuserError with the child's reason when it fails or dies first."""
        self._stopped.clear()
        for old in (self._to_child, self._from_child):  # NOTE: a process slept before
            if old is not None:
                old.close()
        self._reader = threading.Thread(target=self._read, name="muser-engine-reader",
                                        daemon=True)
        ctx = mp.get_context("spawn")
        req_read, req_write = ctx.Pipe(duplex=False)
        out_read, out_write = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child_entry, args=(self.spec, req_read, out_write),
                                 name="muser-engine", daemon=True)
        self._proc.start()
        req_read.close()
        out_write.close()
        self._to_child, self._from_child = req_write, out_read
        try:
            msg = self._from_child.recv()
        except EOFError:
            self._proc.join(5)
            raise MuserError(f"the engine process exited with code {self._proc.exitcode} "
                             "while loading") from None
        if msg[0] == "failed":
            self._proc.join(30)
            raise MuserError(msg[1])
        self.ready = msg[1]
        self.stats = msg[2]
        return self.ready

    def start(self) -> None:
        self._reader.start()

    def sleep(self) -> None:
        """Stop the engine process (the caller knows nothing is in flight): its weights, KV
        and prefix cache leave memory; wake() starts a fresh one."""
        self.asleep = True
        self.stop()

    def wake(self) -> None:
        """A fresh engine process after sleep(), loaded and warmed up. Raises MuserError (the
        engine is then dead: requests get 503)."""
        try:
            self.launch()
        except MuserError as exc:
            self.error = str(exc)
            raise
        finally:
            self.asleep = False
        self.error = None
        self.start()

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, sink: Sink) -> int:
        """Queue a request -> uid; `sink` is called from the reader thread with each StepOutput.
        The caller has checked the prompt (ServerContext.start). Raises QueueFull or
        EngineDead."""
        ready = self.ready
        with self._lock:
            if self.error is not None or self.asleep:
                raise EngineDead(self.error or "the engine is asleep")
            bound = self.max_queue
            if bound is not None and len(self._sinks) >= ready.max_num_seqs + bound:
                raise QueueFull(f"{bound} requests already waiting")
            uid = next(self._uids)
            self._sinks[uid] = sink
            self._send(("add", uid, list(prompt_ids), sampling))
        return uid

    def abort(self, uid: int) -> None:
        """Cancel a request; its sequence and KV are freed before the child's next step."""
        with self._lock:
            if self.error is None and uid in self._sinks:
                self._send(("abort", uid))

    def slot_action(self, action: str, slot: int, filename: str | None) -> Future:
        """Have the engine save / restore / erase a slot -> a Future of ("ok", answer) or
        ("error", status, message, code). Raises EngineDead."""
        fut: Future = Future()
        with self._lock:
            if self.error is not None:
                raise EngineDead(self.error)
            call = next(self._uids)
            self._calls[call] = fut
            self._send(("slot", call, action, slot, filename))
        return fut

    def stop(self) -> None:
        """Ask the child to cancel what is in flight and exit; wait for it (killed when it
        has not said it stopped within STOP_S, or has not exited EXIT_S after saying so)."""
        with self._lock:
            if self.error is None:
                self._send(("stop",))
        if self._proc is None:
            return
        deadline = time.monotonic() + STOP_S
        while (self._proc.is_alive() and not self._stopped.wait(0.1)
               and time.monotonic() < deadline):
            pass
        if self._proc.is_alive() and not self._stopped.is_set():
            log.error("the engine process did not stop within %d s; killing it", STOP_S)
        self._proc.join(EXIT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if self._reader.is_alive():
            self._reader.join(10)

    def _send(self, msg: tuple) -> None:
        try:
            self._to_child.send(msg)
        except (BrokenPipeError, OSError):
            pass  # NOTE: the reader sees the child gone and fails what is in flight

    def _read(self) -> None:
        stopping_ok = False
        while True:
            try:
                kind, outputs, stats = self._from_child.recv()
            except (EOFError, OSError):
                break
            if kind == "stopped":
                stopping_ok = True
                self._stopped.set()
                continue
            if kind == "slot":
                with self._lock:
                    fut = self._calls.pop(outputs, None)
                if fut is not None:
                    fut.set_result(stats)
                continue
            for out in outputs:
                self._deliver(StepOutput(*out))
            if isinstance(stats, LoopStats):
                self.stats = stats
            else:
                steps, rows, preemptions = stats
                self.stats = dataclasses.replace(self.stats, steps=steps, rows=rows,
                                                 preemptions=preemptions)
        self._proc.join(5)
        with self._lock:
            code = self._proc.exitcode
            if not self.asleep:
                self.error = f"the engine process exited with code {code}"
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            fut.set_result(("error", 503, self.error or "the engine is asleep", "engine_dead"))
        if not stopping_ok:
            log.error("%s; failing %d requests in flight", self.error, len(sinks))
        reason = "cancelled" if stopping_ok else "error"
        for uid, sink in sinks.items():
            _call(sink, StepOutput(uid, None, "", True, reason))

    def _deliver(self, out: StepOutput) -> None:
        with self._lock:
            sink = (self._sinks.pop(out.uid, None) if out.finished and out.ends_request
                    else self._sinks.get(out.uid))
        if sink is not None:
            _call(sink, out)


def _call(sink: Sink, out: StepOutput) -> None:
    try:
        sink(out)
    except Exception:
        log.exception("dropping output for request %d", out.uid)


def _child_entry(spec: EngineSpec, requests: Connection, outputs: Connection) -> None:
    """The engine process's first call. NOTE: imported here, in the child only: the module
    imports the engine, and with it torch, which the server process never loads."""
    from muser.server.engine_child import child_main

    child_main(spec, requests, outputs)
