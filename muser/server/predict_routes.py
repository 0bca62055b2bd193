"""/predict: Vertex AI's prediction protocol, as llama-server serves it (AIP_MODE=PREDICTION).

    {"instances": [{"@requestFormat": "chatCompletions", ...the route's body}, ...]}
    -> {"predictions": [the route's reply, ...]}

@requestFormat names a POST route by its path in camelCase without /v1 ("chatCompletions",
"completions", "embeddings", "messages", "applyTemplate", ...) or by the path itself. Each
instance runs through the app as a request of its own (same headers, so the same key), all at
once; streaming is off. An instance that fails is its error body in its place."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute

from muser.server.errors import ApiError

router = APIRouter()

MAX_INSTANCES = 128  # llama-server's bound


def _camel(path: str) -> str:
    """'/v1/chat/completions' -> 'chatCompletions', '/apply-template' -> 'applyTemplate'."""
    words = path.removeprefix("/v1").strip("/").replace("-", "/").replace("_", "/").split("/")
    return words[0] + "".join(w[:1].upper() + w[1:] for w in words[1:])


def formats(routers: list[APIRouter]) -> dict[str, str]:
    """Every POST route of `routers` by its camelCase name (the first one registered wins)
    and by its path."""
    found: dict[str, str] = {}
    for route in (r for router in routers for r in router.routes):
        if isinstance(route, APIRoute) and "POST" in route.methods and route.path != "/predict":
            found.setdefault(_camel(route.path), route.path)
            found.setdefault(route.path, route.path)
    return found


@router.post("/predict")
async def predict(request: Request) -> dict[str, Any]:
    body = await request.app.state.ctx.read_json(request)
    instances = body.get("instances")
    if not isinstance(instances, list):
        raise ApiError(400, "instances: the body needs a list of instances", "invalid_value",
                       "instances")
    if len(instances) > MAX_INSTANCES:
        raise ApiError(400, f"instances: at most {MAX_INSTANCES}", "invalid_value", "instances")
    return {"predictions": await asyncio.gather(*(
        _run(request, request.app.state.predict_formats, instance, i) for i, instance in enumerate(instances)))}


async def _run(request: Request, formats: dict[str, str], instance: Any, i: int) -> Any:
    name = instance.get("@requestFormat") if isinstance(instance, dict) else None
    if not isinstance(name, str):
        return ApiError(400, f"instances.{i}: each instance needs a string @requestFormat",
                        "invalid_value", f"instances.{i}").body()
    if name not in formats:
        return ApiError(400, f"instances.{i}.@requestFormat: no route {name!r}", "invalid_value",
                        f"instances.{i}.@requestFormat").body()
    payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
    if "stream" in payload:
        payload["stream"] = False
    return await _call(request, formats[name], json.dumps(payload).encode())


async def _call(request: Request, path: str, body: bytes) -> Any:
    """POST `body` to `path` through the whole app (middleware and keys included) -> the
    reply's JSON."""
    headers = [(k, v) for k, v in request.scope["headers"]
               if k not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())]
    scope = {**request.scope, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers, "method": "POST"}
    sent, parts = False, []

    async def receive() -> dict[str, Any]:
        """The body, then the outer request's messages (its client leaving ends this one)."""
        nonlocal sent
        if sent:
            return await request.receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    await request.app(scope, receive, send)
    return json.loads(b"".join(parts) or b"null")
