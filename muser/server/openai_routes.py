"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from muser.server.context import ServerContext, sampling_or_400
from muser.server.errors import ApiError
from muser.server.generation import Generation, GenerationStream
from muser.server.protocol import ChatRequest, CompletionRequest

router = APIRouter()

_DEFAULT_COMPLETION_TOKENS = 16


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def _usage(gen: Generation) -> dict[str, Any]:
    return {"prompt_tokens": gen.num_prompt, "completion_tokens": gen.num_output,
            "total_tokens": gen.num_prompt + gen.num_output,
            "prompt_tokens_details": {"cached_tokens": gen.num_cached}}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model",
                                        "created": 0, "owned_by": "muser"}]}


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    ctx = _ctx(request)
    body = await ctx.read_body(request, CompletionRequest)
    ctx.check_model(body.model)
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(
        body.prompt[0], str) else body.prompt
    ids = await ctx.encode(prompt)
    n = ctx.max_tokens(body.max_tokens, _DEFAULT_COMPLETION_TOKENS, "max_tokens")
    gen = ctx.start(ids, sampling_or_400(body.sampling, n))
    head = {"id": f"cmpl-{gen.uid}", "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name}

    def choice(text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    if body.stream:
        return _stream(gen, head, body.include_usage, lambda out: choice(out.text_delta, (
            out.finish_reason if out.finished else None)), None)
    result = await gen.collect(request)
    _raise_if_failed(result.finish_reason)
    return {**head, "choices": [choice(result.text, result.finish_reason)], "usage": _usage(gen)}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    ctx = _ctx(request)
    body = await ctx.read_body(request, ChatRequest)
    ctx.check_model(body.model)
    try:
        text = await run_in_threadpool(ctx.tokenizer.apply_chat_template, body.chat())
    except Exception as exc:  # noqa: BLE001 (the GGUF's template may raise anything)
        raise ApiError(400, f"cannot apply the chat template: {exc}", "invalid_value",
                       "messages") from None
    ids = await ctx.encode(text)
    n = ctx.max_tokens(body.max_completion_tokens or body.max_tokens, ctx.max_model_len,
                       "max_tokens")
    gen = ctx.start(ids, sampling_or_400(body.sampling, n))
    head = {"id": f"chatcmpl-{gen.uid}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": ctx.model_name}

    def choice(out: Any) -> dict[str, Any]:
        delta = {"content": out.text_delta} if out.text_delta or not out.finished else {}
        return {"index": 0, "delta": delta, "logprobs": None,
                "finish_reason": out.finish_reason if out.finished else None}

    if body.stream:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
        return _stream(gen, head, body.include_usage, choice, first)
    result = await gen.collect(request)
    _raise_if_failed(result.finish_reason)
    message = {"role": "assistant", "content": result.text}
    return {**head, "object": "chat.completion", "usage": _usage(gen),
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": result.finish_reason}]}


def _stream(gen: Generation, head: dict[str, Any], include_usage: bool,
            choice: Callable[[Any], dict[str, Any]], first: dict[str, Any] | None
            ) -> GenerationStream:
    async def events() -> AsyncIterator[str]:
        if first is not None:
            yield sse({**head, "choices": [first]})
        async for out in gen.outputs():
            if out.finish_reason in ("error", "cancelled"):
                yield sse(ApiError(500, f"generation {out.finish_reason}", out.finish_reason)
                          .body())
                return
            yield sse({**head, "choices": [choice(out)]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": _usage(gen)})
        yield "data: [DONE]\n\n"

    return GenerationStream(gen, events())


def _raise_if_failed(reason: str) -> None:
    if reason in ("error", "cancelled"):
        raise ApiError(500 if reason == "error" else 503, f"generation {reason}", reason)
