"""Sleep: with --sleep-idle-seconds S, the engine process stops once no request has needed it for
S seconds (its weights, KV and prefix cache leave memory, the device's included) and starts
again, loaded and warmed up, when a request needs it (llama-server's sleeping state; /props
shows is_sleeping).

Read-only routes (/health, /props, /models, /metrics, GET /slots) neither need the engine nor
wake it; every other route wakes it before it runs. Requests are counted by the app's ASGI
middleware from their first byte to their last (a stream included), and the decision to sleep
is taken on the event loop while none is in flight, so no request can reach the engine while it
stops: one that arrives meanwhile waits for it to stop, then wakes it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.concurrency import run_in_threadpool
from starlette.types import Scope

from muser.server.engine_process import EngineProcess

log = logging.getLogger("muser.server")

READ_ONLY = ("/health", "/v1/health", "/props", "/models", "/v1/models", "/metrics")


class Sleep:
    def __init__(self, idle_s: float | None) -> None:
        """idle_s: --sleep-idle-seconds (None: the engine never sleeps)."""
        self.idle_s = idle_s
        self.in_flight = 0  # requests that need the engine, from their first byte to their last
        self._last = time.monotonic()  # when one last began or ended
        self._power = asyncio.Lock()  # one sleep or wake at a time

    @staticmethod
    def wakes(scope: Scope) -> bool:
        """Whether a request needs the engine (every route but the read-only ones)."""
        path = scope["path"]
        return not (path in READ_ONLY or (path == "/slots" and scope["method"] == "GET"))

    def begin(self) -> None:
        self.in_flight += 1
        self._last = time.monotonic()

    def end(self) -> None:
        self.in_flight -= 1
        self._last = time.monotonic()

    async def awake(self, engine: EngineProcess) -> None:
        """Before a request that needs the engine: start it again if it sleeps (or is falling
        asleep)."""
        if not (engine.asleep or self._power.locked()):
            return
        async with self._power:
            if engine.asleep:
                log.info("waking up: starting the engine process")
                await run_in_threadpool(engine.wake)

    async def watch(self, engine: EngineProcess) -> None:
        """Put the engine to sleep whenever it has been idle for idle_s (runs for the server's
        lifetime)."""
        while True:
            await asyncio.sleep(min(0.25, self.idle_s / 4))
            if engine.asleep or engine.error is not None or self.in_flight or (
                    time.monotonic() - self._last < self.idle_s):
                continue
            async with self._power:
                if not self.in_flight and not engine.asleep:
                    log.info("idle for %.3g s: stopping the engine process", self.idle_s)
                    engine.asleep = True  # NOTE: on the event loop: awake() now waits for us
                    await run_in_threadpool(engine.sleep)
