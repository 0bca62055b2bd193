"""EngineProcess: the engine loop runs in a child process; the server process speaks HTTP.

In one process the event loop (HTTP parsing, JSON, the SSE chunks of every stream) and the
engine loop (scheduling, kernel launches, sampling) share one GIL: each waits for the other
between its steps, and under load the engine launches late. Here the child owns the model and
the EngineLoop; the server keeps the tokenizer and talks to the child over two pipes:

    server -> child   ("add", uid, prompt_ids, sampling) | ("abort", uid) | ("stop",)
                      | ("slot", call_id, action, slot, filename)
    child -> server   ("ready", Ready) | ("failed", message) once, then per engine step
                      ("step", [(uid, token_id, text_delta, finished, finish_reason,
                      num_reused, logprobs, prompt_logprobs, index, ends_request)...],
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
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from muser.core import SamplingParams, StepOutput, check_prompt
from muser.errors import MuserError
from muser.memory import MemoryReport
from muser.scheduler import QueueFull
from muser.server.loop import EngineLoop, LoopStats
from muser.tokenizer import Tokenizer

log = logging.getLogger("muser.server")

STATS_INTERVAL_S = 0.05
STOP_S, EXIT_S = 60, 10  # stop(): waits for the child's "stopped", then for its exit
Sink = Callable[[StepOutput], None]


class EngineDead(MuserError):
    """The engine process has exited; nothing more can be served."""


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build the engine: LLM(model, **llm_kwargs)."""

    model: str | None
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    log_level: str = "info"
    progress: bool = False
    disagg: dict[str, Any] | None = None  # muser.disagg.client.attach's keywords
    slot_save_path: str | None = None  # where slot files live (None: no save / restore)


@dataclass(frozen=True)
class Ready:
    tokenizer: Tokenizer
    model_path: str
    max_model_len: int
    max_num_seqs: int
    memory: MemoryReport | None
    batching: dict[str, Any]  # the step limits the engine runs with (GPU: how one was measured)


class EngineProcess:
    """The server's side: submit / abort / stats / stop, as an in-process EngineLoop offers."""

    def __init__(self, spec: EngineSpec, max_queue: int | None) -> None:
        """max_queue: most requests waiting beyond max_num_seqs before submit raises QueueFull."""
        self.spec, self.max_queue = spec, max_queue
        self.stats = LoopStats()
        self.ready: Ready | None = None
        self.error: str | None = None  # why the engine process is gone, once it is
        self._sinks: dict[int, Sink] = {}
        self._calls: dict[int, Future] = {}  # slot actions waiting for the child's answer
        self._lock = threading.Lock()  # sinks, error and the pipe to the child
        self._uids = itertools.count()
        self._proc: mp.process.BaseProcess | None = None
        self._to_child: Connection | None = None
        self._from_child: Connection | None = None
        self._stopped = threading.Event()  # the child said it stopped
        self._reader = threading.Thread(target=self._read, name="muser-engine-reader",
                                        daemon=True)

    def launch(self) -> Ready:
        """Start the child and wait until its engine is loaded and warmed up -> Ready.
        Raises MuserError with the child's reason when it fails or dies first."""
        ctx = mp.get_context("spawn")
        req_read, req_write = ctx.Pipe(duplex=False)
        out_read, out_write = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child_main, args=(self.spec, req_read, out_write),
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

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, sink: Sink) -> int:
        """Queue a request -> uid; `sink` is called from the reader thread with each StepOutput.
        Raises PromptError, QueueFull, or EngineDead."""
        ready = self.ready
        check_prompt(prompt_ids, ready.max_model_len)
        with self._lock:
            if self.error is not None:
                raise EngineDead(self.error)
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
            self.error = f"the engine process exited with code {code}"
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            fut.set_result(("error", 503, self.error, "engine_dead"))
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


def _child_main(spec: EngineSpec, requests: Connection, outputs: Connection) -> None:
    """The engine process: build the engine, then run its loop until told to stop or until the
    server's pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        loop = _build(spec, outputs)
    except BaseException as exc:
        if not isinstance(exc, MuserError):
            log.exception("engine startup failed")
        outputs.send(("failed", str(exc) if isinstance(exc, MuserError) else
                      f"startup failed: {type(exc).__name__}: {exc}"))
        return
    loop.start()
    while True:
        try:
            msg = requests.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "add":
            _, uid, prompt_ids, sampling = msg
            try:
                loop.submit(prompt_ids, sampling, loop.on_output, uid=uid)
            except Exception as exc:  # noqa: BLE001  (the server checked it first; not fatal)
                log.error("request %d refused by the engine: %s", uid, exc)
                loop.refuse(uid)
        elif msg[0] == "abort":
            loop.abort(msg[1])
        elif msg[0] == "slot":
            _, call, action, slot, filename = msg
            loop.call(lambda _engine, a=(action, slot, filename): loop.slots(*a),
                      lambda result, call=call: loop.answer(call, result))
        else:
            break
    loop.stop()
    try:
        outputs.send(("stopped", None, None))
    except (BrokenPipeError, OSError):
        pass
    # NOTE: nothing here needs the interpreter's teardown (the driver frees the device's memory
    # at exit), and a thread some library left behind must not keep the process alive
    logging.shutdown()
    os._exit(0)


def _build(spec: EngineSpec, outputs: Connection) -> EngineLoop:
    from muser import LLM
    from muser.startup import StartupLog

    llm = LLM(spec.model, progress=spec.progress,
              log=StartupLog(logging.getLogger("muser.startup").info), **spec.llm_kwargs)
    if spec.disagg is not None:
        from muser.disagg.client import attach

        attach(llm, **spec.disagg)
    from muser.slot_actions import SlotActions

    slots = SlotActions(llm.engine, spec.slot_save_path, functools.cache(llm.fingerprint))
    loop = _PipeLoop(llm.engine, outputs, slots)
    c, phases = llm.config, llm.runner.startup.phases
    ready = Ready(llm.tokenizer, str(llm.path), c.max_model_len, c.max_num_seqs,
                  llm.runner.memory, {"max_num_seqs": c.max_num_seqs,
                                      "max_batched_tokens": c.max_batched_tokens,
                                      "decode_waiting_chunk": c.decode_waiting_chunk,
                                      "prefill_chunk": c.prefill_chunk}
                  | ({"decode_waiting_chunk_measured": phases["chunk cap"]}
                     if "chunk cap" in phases else {}))
    outputs.send(("ready", ready, loop.stats))
    return loop


class _PipeLoop(EngineLoop):
    """An EngineLoop whose outputs of each step go to the server as one message."""

    def __init__(self, engine, outputs: Connection, slots: Callable[..., dict]) -> None:
        """slots: the slot actions (muser.slot_actions.SlotActions)."""
        super().__init__(engine, None)
        self.slots = slots
        EngineLoop._snapshot(self)  # NOTE: the Ready message's stats; nothing sent yet
        self._outputs = outputs
        self._send_lock = threading.Lock()  # the loop thread's steps, the main thread's refusals
        self._pending: list[tuple] = []
        self._seen: set[int] = set()  # requests with an output sent and not finished
        self._stats_due = True
        self._stats_sent = 0.0

    def on_output(self, out: StepOutput) -> None:
        """The sink of every request (called on the loop thread)."""
        self._pending.append((out.uid, out.token_id, out.text_delta, out.finished,
                              out.finish_reason, out.num_reused, out.logprobs,
                              out.prompt_logprobs, out.index, out.ends_request))
        if out.finished and out.ends_request:
            self._stats_due = True
            self._seen.discard(out.uid)
        elif out.uid not in self._seen:
            self._stats_due = True
            self._seen.add(out.uid)

    def _snapshot(self) -> None:
        now = time.perf_counter()
        send_stats = self._stats_due or now - self._stats_sent >= STATS_INTERVAL_S
        if send_stats:
            super()._snapshot()
        if not (self._pending or send_stats):
            return
        pending, self._pending = self._pending, []
        st = self.engine.scheduler.stats
        counts = self.stats if send_stats else (dict(st.steps), dict(st.rows), st.preemptions)
        if not self._send(("step", pending, counts)):
            return  # NOTE: the server is gone; the request pipe's EOF stops the loop
        if send_stats:
            self._stats_due, self._stats_sent = False, now

    def answer(self, call: int, result: object) -> None:
        """A slot action's outcome to the server (on the loop thread)."""
        from muser.slot_actions import SlotError

        if isinstance(result, SlotError):
            reply = ("error", result.status, str(result), result.code)
        elif isinstance(result, BaseException):
            log.error("slot action failed: %s: %s", type(result).__name__, result)
            reply = ("error", 500, f"slot action failed: {type(result).__name__}: {result}",
                     "internal_error")
        else:
            reply = ("ok", result)
        self._send(("slot", call, reply))

    def refuse(self, uid: int) -> None:
        """End a request the engine could not take (from the main thread)."""
        st = self.engine.scheduler.stats
        self._send(("step", [(uid, None, "", True, "error", 0)],
                    (dict(st.steps), dict(st.rows), st.preemptions)))

    def _send(self, msg: tuple) -> bool:
        with self._send_lock:
            try:
                self._outputs.send(msg)
            except (BrokenPipeError, OSError):
                return False
        return True
