"""ApiError and the OpenAI-style error body every 4xx/5xx carries; the error of a generation
that did not finish."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error", 500: "server_error",
          501: "not_supported_error"}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None,
                 kind: str | None = None, extra: dict[str, Any] | None = None) -> None:
        """kind: the body's `type` (default: from the status); extra: more `error` fields."""
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers, self.kind, self.extra = headers, kind, extra or {}

    def body(self) -> dict[str, Any]:
        kind = self.kind or _TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code, **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error, including unknown routes and framework validation, gets the same body."""

    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(400, str(exc.errors()[:1]), "invalid_request").response()

    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return ApiError(500, "internal server error", "internal_error").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)


def generation_failed(reason: str, error: str | None) -> ApiError:
    """The error of a generation that ended with "error" or "cancelled" (before its end, or
    mid-stream as the SSE event that ends the stream): the request's own grammar failed (the
    engine's words, e.g. a mask past --grammar-mask-ms) -> 400; the engine failed -> 500; the
    server cancelled it (shutting down) -> 503."""
    if reason == "error" and error is not None:
        return ApiError(400, error, "grammar_failed")
    return ApiError(500 if reason == "error" else 503, f"generation {reason}", reason)


def bad_field(param: str, message: str) -> ApiError:
    """A 400 naming the request field `param` (the compatibility routes' bodies)."""
    return ApiError(400, f"{param}: {message}", "invalid_value", param)


def refuse_unknown(body: dict[str, Any], known: frozenset[str], why: str = "") -> None:
    """A 400 naming the first field of `body` not in `known` (`why`: what the route says)."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_field(unknown[0], "unknown field; this server does not support it" + why)
