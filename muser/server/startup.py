"""Startup: the engine is built on a background thread while the server already answers, with
503 {"status": "loading"} on /health and 503 + Retry-After on every other route, until the
model is loaded and warmed up (every kernel, pick and graph serving uses:
`muser/startup/warmup.py`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from muser.server.context import ServerContext
from muser.server.errors import ApiError

log = logging.getLogger("muser.server")

RETRY_AFTER_S = 5


class Startup:
    def __init__(self, build: Callable[[], ServerContext],
                 on_failure: Callable[[BaseException], None]) -> None:
        """build: loads and warms the engine -> its context; on_failure: called from the
        loading thread with what `build` raised."""
        self.build, self.on_failure = build, on_failure
        self.ctx: ServerContext | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="muser-startup", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def ready_ctx(self) -> ServerContext:
        """The context once ready; raises the 503 every route but /health answers before."""
        if self.ctx is None:
            raise ApiError(503, "the model is loading; retry later", "loading",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        return self.ctx

    def _run(self) -> None:
        try:
            ctx = self.build()
            ctx.loop.start()
        except BaseException as exc:  # noqa: BLE001  (reported, and the server stops)
            self.error = exc
            self.on_failure(exc)
            return
        self.ctx = ctx
        log.info("ready: serving %s", ctx.model_name)
