"""create_app: routes, keys, error bodies and metrics around one engine process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from muser.server import (
    embedding_routes,
    llama_routes,
    messages_routes,
    openai_routes,
    predict_routes,
    responses_routes,
    slot_routes,
)
from muser.server.cors import Cors
from muser.server.errors import ApiError, install_error_handlers
from muser.server.metrics import Metrics
from muser.server.sleep import Sleep
from muser.server.startup import Startup

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/completion", "/tokenize",
          "/detokenize", "/health", "/props", "/slots", "/metrics", "/apply-template", "/infill",
          "/v1/embeddings", "/embedding", "/v1/messages", "/v1/messages/count_tokens",
          "/v1/responses", "/v1/responses/input_tokens", "/predict")
# NOTE: llama-server's other names for the same handlers (declared beside each route); metrics
# count them under the route
ALIASES = {"/completions": "/completion", "/chat/completions": "/v1/chat/completions",
           "/models": "/v1/models", "/v1/health": "/health", "/embeddings": "/embedding",
           "/responses": "/v1/responses", "/responses/input_tokens": "/v1/responses/input_tokens"}


async def _ready(request: Request) -> None:
    ctx = request.app.state.ctx = request.app.state.startup.ready_ctx()
    if Sleep.wakes(request.scope):
        await request.app.state.sleep.awake(ctx.loop)


def _user(request: Request) -> None:
    request.app.state.ctx.keys.check_user(request)


def _admin(request: Request) -> None:
    request.app.state.ctx.keys.check_admin(request)


async def _metrics(request: Request) -> Response:
    if not request.app.state.ctx.options.metrics:
        raise ApiError(501, "/metrics is disabled: start the server without --no-metrics",
                       "not_supported")
    response = Response(request.app.state.ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
    # NOTE: named as llama-server writes it (starlette lowercases names given as headers=)
    response.raw_headers.append((b"Process-Start-Time-Unix",
                                 str(request.app.state.started).encode()))
    return response


class _RequestCounter:
    """Counts the HTTP responses of the routes that need the engine by route and status code
    (pure ASGI: streaming untouched). The read-only probes (Sleep.wakes false: /health, /props,
    /models, /metrics, GET /slots) are not counted: a scraper or a load balancer polling them
    is no traffic, and a sleeping server's metrics stay as they were."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = ALIASES.get(scope["path"], scope["path"])
        route = "/slots" if path.startswith("/slots/") else path if path in ROUTES else "other"

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                scope["app"].state.metrics.observe_request(route, message["status"])
            await send(message)

        if not Sleep.wakes(scope):
            return await self.app(scope, receive, send)
        sleep = scope["app"].state.sleep
        sleep.begin()
        try:
            await self.app(scope, receive, counted_send)
        finally:
            sleep.end()


async def _watch_when_ready(startup: Startup, sleep: Sleep) -> None:
    while startup.ctx is None:
        await asyncio.sleep(0.25)
    await sleep.watch(startup.ctx.loop)


def create_app(startup: Startup, metrics: Metrics, sleep_idle_s: float | None = None
               ) -> FastAPI:
    """The app around an engine that `startup` builds in the background (503 until ready);
    sleep_idle_s: --sleep-idle-seconds (muser/server/sleep.py)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        startup.start()
        watch = asyncio.ensure_future(_watch_when_ready(startup, app.state.sleep)) if (
            sleep_idle_s is not None) else None
        yield
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        app.state.draining = True
        if startup.ctx is not None:
            startup.ctx.loop.stop()
            startup.ctx.grammars.close()

    app = FastAPI(title="muser", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.startup, app.state.metrics, app.state.ctx = startup, metrics, None
    app.state.draining, app.state.started = False, int(time.time())
    app.state.sleep = Sleep(sleep_idle_s)
    install_error_handlers(app)
    app.include_router(llama_routes.health_router)
    user, admin = [Depends(_ready), Depends(_user)], [Depends(_ready), Depends(_admin)]
    routers = [openai_routes.router, llama_routes.router, embedding_routes.router,
               messages_routes.router, responses_routes.router, predict_routes.router]
    for router in routers:
        app.include_router(router, dependencies=user)
    app.state.predict_formats = predict_routes.formats(routers)
    app.include_router(slot_routes.router, dependencies=admin)
    app.add_api_route("/metrics", _metrics, methods=["GET"], dependencies=user)
    app.add_middleware(_RequestCounter)
    app.add_middleware(Cors)
    return app

