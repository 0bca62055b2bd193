"""CORS as llama-server does it: allowed origins are reflected, preflights answer 200 on any path.

Origins come from --cors-origins: 'localhost' stands for any http(s) origin on localhost,
127.0.0.1 or [::1] (any port), '*' for any origin, anything else is compared exactly."""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from muser.server.options import ServerOptions

_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
# NOTE: names as llama-server writes them (a client that copies the headers into a plain dict
# looks them up so)
_PREFLIGHT = [(b"Access-Control-Allow-Methods", b"GET, POST, DELETE, OPTIONS"),
              (b"Access-Control-Allow-Headers", b"*"), (b"Access-Control-Max-Age", b"600")]


def is_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    if "*" in allowed or origin in allowed:
        return True
    if "localhost" not in allowed:
        return False
    try:
        url = urlsplit(origin)
        return url.scheme in ("http", "https") and url.hostname in _LOCAL_HOSTS
    except ValueError:
        return False


class Cors:
    """Pure ASGI (streaming untouched). Preflights never reach the routes or the key checks."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin", b"").decode("latin-1")
        ctx = scope["app"].state.startup.ctx
        allowed = (ctx.options if ctx else ServerOptions()).cors_origins
        granted = [(b"Access-Control-Allow-Origin", origin.encode("latin-1")),
                   (b"Access-Control-Allow-Credentials", b"true"), (b"Vary", b"Origin")
                   ] if origin and is_allowed(origin, allowed) else [(b"Vary", b"Origin")]
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            await send({"type": "http.response.start", "status": 200,
                        "headers": granted + _PREFLIGHT + [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_granted(message: Message) -> None:
            if message["type"] == "http.response.start" and origin:
                message = {**message, "headers": list(message.get("headers", [])) + granted}
            await send(message)

        await self.app(scope, receive, send_granted)
