"""create_app: routes, keys, error bodies and metrics around one engine process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from muser.server import llama_routes, openai_routes, slot_routes
from muser.server.cors import Cors
from muser.server.errors import ApiError, install_error_handlers
from muser.server.metrics import Metrics
from muser.server.startup import Startup

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/completion", "/tokenize",
          "/detokenize", "/health", "/props", "/slots", "/metrics", "/apply-template", "/infill")
# NOTE: llama-server's other names for the same handlers (declared beside each route); metrics
# count them under the route
ALIASES = {"/completions": "/completion", "/chat/completions": "/v1/chat/completions",
           "/models": "/v1/models", "/v1/health": "/health"}


def _ready(request: Request) -> None:
    request.app.state.ctx = request.app.state.startup.ready_ctx()


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
    """Counts every HTTP response by route and status code (pure ASGI: streaming untouched)."""

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

        await self.app(scope, receive, counted_send)


def create_app(startup: Startup, metrics: Metrics) -> FastAPI:
    """The app around an engine that `startup` builds in the background (503 until ready)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        startup.start()
        yield
        app.state.draining = True
        if startup.ctx is not None:
            startup.ctx.loop.stop()
            startup.ctx.grammars.close()

    app = FastAPI(title="muser", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.startup, app.state.metrics, app.state.ctx = startup, metrics, None
    app.state.draining, app.state.started = False, int(time.time())
    install_error_handlers(app)
    app.include_router(llama_routes.health_router)
    user, admin = [Depends(_ready), Depends(_user)], [Depends(_ready), Depends(_admin)]
    app.include_router(openai_routes.router, dependencies=user)
    app.include_router(llama_routes.router, dependencies=user)
    app.include_router(slot_routes.router, dependencies=admin)
    app.add_api_route("/metrics", _metrics, methods=["GET"], dependencies=user)
    app.add_middleware(_RequestCounter)
    app.add_middleware(Cors)
    return app

