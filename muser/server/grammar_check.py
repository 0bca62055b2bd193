"""GrammarCheck: a request's schema or grammar compiled and checked in worker processes.

CHECK_WORKERS processes, started with the server, each hold the vocabulary table and check
one grammar at a time: the grammar text is built (muser/server/structured.py), compiled
against the vocabulary and its first token mask computed, under the same GrammarLimits the
engine applies (muser/constraint.py). Processes, not threads: no check ever holds the server's
GIL (part of the work is Python), and each runs at a lower CPU priority (nice CHECK_NICE) than
the processes that serve streams, so a flood of costly grammars waits for the CPU and the
running streams do not. A check that takes more than limits.compile_s is refused and its
worker killed and replaced. The engine compiles the grammar again on its side, off its step
loop.

    server -> worker   (kind, spec)
    worker -> server   ("ready",) once, then ("ok", grammar text) | ("error", reason)
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import pickle
from multiprocessing.connection import Connection
from typing import Any

from muser.constraint import GrammarError, GrammarLimits, Vocab, compile_constraint
from muser.errors import MuserError
from muser.server.structured import compile_grammar
from muser.tokenizer import Tokenizer

log = logging.getLogger("muser.server")

CHECK_WORKERS = 2
CHECK_NICE = 10


class _Worker:
    """One checking process and the server's end of its pipe."""

    def __init__(self, tokenizer: bytes, limits: GrammarLimits) -> None:
        """Starts the process (wait_ready: until its vocabulary table is built). `tokenizer`:
        pickled once by GrammarCheck (a Tokenizer pickled here, on the thread that replaces a
        worker, held the server's GIL 0.2-0.8 s, and every stream waited)."""
        # NOTE: forked from a fresh forkserver process (no torch, no server state in it), so
        # they start quickly and are no children of the server beside its engine process
        ctx = mp.get_context("forkserver")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(tokenizer, limits, child),
                                name="muser-grammar-check", daemon=True)
        self.proc.start()
        child.close()

    def wait_ready(self) -> _Worker:
        try:
            self.conn.recv()
        except EOFError:
            raise MuserError(f"a grammar check process exited with code "
                             f"{self.proc.exitcode} while starting") from None
        return self

    def call(self, kind: str, spec: Any) -> tuple[str, str]:
        self.conn.send((kind, spec))
        return self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class GrammarCheck:
    def __init__(self, tokenizer: Tokenizer, limits: GrammarLimits) -> None:
        """Starts the workers (each builds the vocabulary table, 1.5-4 s)."""
        self.tokenizer, self.limits = tokenizer, limits
        self._pickled = pickle.dumps(tokenizer)
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for worker in [_Worker(self._pickled, limits) for _ in range(CHECK_WORKERS)]:
            self._idle.put_nowait(worker.wait_ready())

    async def check(self, kind: str, spec: Any) -> str:
        """kind "schema" | "grammar" -> llguidance grammar text; GrammarError with the reason
        it is refused."""
        loop = asyncio.get_running_loop()
        worker = await self._idle.get()
        fut = loop.run_in_executor(None, worker.call, kind, spec)
        try:
            status, answer = await asyncio.wait_for(asyncio.shield(fut), self.limits.compile_s)
        except TimeoutError:
            log.warning("a grammar check took more than %g s; restarting its worker",
                        self.limits.compile_s)
            fut.add_done_callback(_consume)  # NOTE: it ends in EOFError once killed
            loop.run_in_executor(None, self._replace, worker, loop)
            raise GrammarError(f"compiling and checking it took more than "
                               f"{self.limits.compile_s:g} s (--grammar-compile-s)") from None
        except (EOFError, OSError):
            log.warning("a grammar check process exited (code %s) while checking a request's "
                        "%s; restarting it", worker.proc.exitcode, kind)
            loop.run_in_executor(None, self._replace, worker, loop)
            raise GrammarError("checking it made the checking process exit") from None
        except asyncio.CancelledError:
            # NOTE: the client went away; the worker is free again once its answer is in
            fut.add_done_callback(_consume)
            fut.add_done_callback(lambda _: self._idle.put_nowait(worker))
            raise
        self._idle.put_nowait(worker)
        if status != "ok":
            raise GrammarError(answer)
        return answer

    def close(self) -> None:
        """Stop the idle workers (one still checking exits when its pipe closes)."""
        while not self._idle.empty():
            self._idle.get_nowait().kill()

    def _replace(self, worker: _Worker, loop: asyncio.AbstractEventLoop) -> None:
        """Kill a worker, start another and put it in the idle queue (on an executor thread)."""
        worker.kill()
        fresh = _Worker(self._pickled, self.limits).wait_ready()
        loop.call_soon_threadsafe(self._idle.put_nowait, fresh)


def _consume(fut: asyncio.Future) -> None:
    """Retrieve the outcome of a call no request waits for any more (asyncio logs a
    traceback for an exception never retrieved)."""
    if not fut.cancelled():
        fut.exception()


def _serve(tokenizer: bytes, limits: GrammarLimits, conn: Connection) -> None:
    """A worker: check grammars until the server's end of the pipe closes."""
    os.nice(CHECK_NICE)
    vocab = Vocab(pickle.loads(tokenizer))
    vocab.get()
    parser_limits = limits.parser_limits()
    conn.send(("ready",))
    while True:
        try:
            kind, spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            grammar = compile_grammar(kind, spec, parser_limits)
            compile_constraint(vocab, grammar, limits, check=True)
            conn.send(("ok", grammar))
        except GrammarError as exc:
            conn.send(("error", str(exc)))
        except Exception as exc:  # noqa: BLE001  (reported to the request, the worker goes on)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
