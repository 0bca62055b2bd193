"""The engine process's side of EngineProcess (muser/server/engine_process.py): build the
engine, run its EngineLoop, and answer the server over the pipes (the protocol is described
there). Only this process imports the engine (and torch)."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from muser.core import StepOutput
from muser.disagg.client import attach
from muser.errors import MuserError
from muser.llm import LLM
from muser.server.engine_spec import EngineSpec, Ready
from muser.server.loop import EngineLoop
from muser.slot_actions import SlotActions, SlotError
from muser.startup import StartupLog

log = logging.getLogger("muser.server")

STATS_INTERVAL_S = 0.05


def child_main(spec: EngineSpec, requests: Connection, outputs: Connection) -> None:
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
                # NOTE: the HTTP process checked the prompt (ServerContext.start)
                loop.submit(prompt_ids, sampling, loop.on_output, uid=uid, checked=True)
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
    llm = LLM(spec.model, progress=spec.progress,
              log=StartupLog(logging.getLogger("muser.startup").info), **spec.llm_kwargs)
    if spec.disagg is not None:
        attach(llm, **spec.disagg)
    # NOTE: the engine builds GrammarMasks with the defaults; the server's flags replace them.
    # The vocabulary table is built now: built by a first constrained request, it would hold
    # the GIL for seconds while the loop thread steps every other stream
    llm.engine.grammars.limits = spec.grammar_limits
    llm.engine.grammars.vocab.get()
    slots = SlotActions(llm.engine, spec.slot_save_path, functools.cache(llm.fingerprint))
    loop = _PipeLoop(llm.engine, outputs, slots)
    c, phases = llm.config, llm.runner.startup.phases
    ready = Ready(llm.tokenizer, str(llm.path), c.max_model_len, c.max_num_seqs,
                  llm.runner.memory, {"max_num_seqs": c.max_num_seqs,
                                      "max_batched_tokens": c.max_batched_tokens,
                                      "decode_waiting_chunk": c.decode_waiting_chunk,
                                      "prefill_chunk": c.prefill_chunk}
                  | ({"decode_waiting_chunk_measured": phases["chunk cap"]}
                     if "chunk cap" in phases else {}), llm.model_config.hidden_size)
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
                              out.prompt_logprobs, out.index, out.ends_request, out.error,
                              out.num_drafted, out.num_accepted, out.progress,
                              out.embedding))
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
        """A slot action's outcome to the server (on the loop thread), after the stats it
        changed (a slot's cache), so /slots shows them once the answer is in."""
        self._stats_due = True
        self._snapshot()
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
