"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Request

from muser.server import logit_bias
from muser.server.context import ServerContext, is_llama_path, sampling_or_400, with_defaults
from muser.server.errors import ApiError
from muser.server.generation import Generation, GenerationStream
from muser.server.protocol import ChatRequest, CompletionRequest
from muser.server.results import timings

router = APIRouter()

_DEFAULT_COMPLETION_TOKENS = 16
SYSTEM_FINGERPRINT = f"b{version('muser')}-muser"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def _usage(gen: Generation) -> dict[str, Any]:
    return {"prompt_tokens": gen.num_prompt, "completion_tokens": gen.num_output,
            "total_tokens": gen.num_prompt + gen.num_output,
            "prompt_tokens_details": {"cached_tokens": gen.num_cached}}


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": 0,
                                        "owned_by": "muser", "aliases": list(ctx.aliases)}]}


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    ctx = _ctx(request)
    body = with_defaults(await ctx.read_body(request, CompletionRequest), ctx)
    ctx.check_model(body.model)
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(
        body.prompt[0], str) else body.prompt
    ids = await ctx.encode(prompt)
    n = ctx.max_tokens(body.max_tokens, _DEFAULT_COMPLETION_TOKENS, "max_tokens")
    llama = is_llama_path(request)
    bias = logit_bias.resolve(ctx.tokenizer, body.logit_bias, openai=not llama)
    gen = ctx.start(ids, sampling_or_400(body.sampling, n, bias), llama)
    head = _head(ctx, f"cmpl-{gen.uid}", "text_completion")

    def choice(text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    if body.stream:
        return _stream(ctx, gen, head, body.include_usage, llama, lambda text: choice(text, None),
                       lambda reason: choice("", reason), None)
    result = await gen.collect(request)
    _raise_if_failed(result.finish_reason)
    ctx.metrics.observe_finished(gen)
    return {**head, "choices": [choice(result.text, result.finish_reason)],
            "usage": _usage(gen)}


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(request: Request) -> Any:
    ctx = _ctx(request)
    body = with_defaults(await ctx.read_body(request, ChatRequest), ctx)
    ctx.check_model(body.model)
    llama = is_llama_path(request)
    prompt = await _chat_prompt(ctx, body, llama)
    ids = await ctx.encode(prompt)
    n = ctx.max_tokens(body.max_completion_tokens or body.max_tokens, ctx.max_model_len,
                       "max_tokens")
    bias = logit_bias.resolve(ctx.tokenizer, body.logit_bias, openai=not llama)
    gen = ctx.start(ids, sampling_or_400(body.sampling, n, bias), llama)
    head = _head(ctx, f"chatcmpl-{gen.uid}", "chat.completion.chunk")

    def choice(delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

    if body.stream:
        # NOTE: the role chunk's content: "" as OpenAI sends it, null as llama-server does
        first = choice({"role": "assistant", "content": None if llama else ""}, None)
        return _stream(ctx, gen, head, body.include_usage, llama,
                       lambda text: choice({"content": text}, None),
                       lambda reason: choice({}, reason), first)
    result = await gen.collect(request)
    _raise_if_failed(result.finish_reason)
    ctx.metrics.observe_finished(gen)
    message = {"role": "assistant", "content": result.text}
    verbose = {"__verbose": {"prompt": prompt}} if body.verbose or ctx.options.verbose else {}
    return {**head, "object": "chat.completion", "usage": _usage(gen),
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": result.finish_reason}], **verbose}


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")
async def chat_input_tokens(request: Request) -> dict[str, int]:
    """How many tokens the conversation's prompt takes (nothing is generated)."""
    ctx = _ctx(request)
    body = await ctx.read_body(request, ChatRequest)
    ids = await ctx.encode(await _chat_prompt(ctx, body, is_llama_path(request)))
    return {"input_tokens": len(ids)}


async def _chat_prompt(ctx: ServerContext, body: ChatRequest, llama: bool) -> str:
    """The rendered conversation. Off /v1/* a final assistant message is continued (llama-server's
    prefill); on /v1/* only when continue_final_message asks."""
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(400, "continue_final_message: set add_generation_prompt to false with it",
                       "invalid_value", "continue_final_message")
    messages = body.chat()
    prefill = llama and body.add_generation_prompt and messages[-1]["role"] == "assistant"
    if prefill and len(messages) > 1 and messages[-2]["role"] == "assistant":
        raise ApiError(400, "Cannot have 2 or more assistant messages at the end of the list "
                       "(the last one is continued)", "invalid_value", "messages")
    continued = body.continue_final_message or prefill
    return await ctx.render_chat(messages, body.add_generation_prompt and not continued,
                                 continue_final_message=continued)


def _head(ctx: ServerContext, uid: str, kind: str) -> dict[str, Any]:
    return {"id": uid, "object": kind, "created": int(time.time()), "model": ctx.model_name,
            "system_fingerprint": SYSTEM_FINGERPRINT}


def _stream(ctx: ServerContext, gen: Generation, head: dict[str, Any], include_usage: bool,
            llama: bool, content: Callable[[str], dict[str, Any]],
            finish: Callable[[str], dict[str, Any]], first: dict[str, Any] | None
            ) -> GenerationStream:
    """[first], one chunk per non-empty text delta, the finish reason in a chunk of its own,
    [usage (with llama-server's timings off /v1/*)], [DONE]."""
    async def events() -> AsyncIterator[str]:
        if first is not None:
            yield sse({**head, "choices": [first]})
        async for out in gen.outputs():
            if out.finish_reason in ("error", "cancelled"):
                yield sse(ApiError(500, f"generation {out.finish_reason}", out.finish_reason)
                          .body())
                return
            if out.text_delta:
                yield sse({**head, "choices": [content(out.text_delta)]})
        yield sse({**head, "choices": [finish(gen.finish_reason)]})
        ctx.metrics.observe_finished(gen)
        if include_usage:
            usage = {**head, "choices": [], "usage": _usage(gen)}
            yield sse({**usage, "timings": timings(gen)} if llama else usage)
        yield "data: [DONE]\n\n"

    return GenerationStream(gen, events())


def _raise_if_failed(reason: str) -> None:
    if reason in ("error", "cancelled"):
        raise ApiError(500 if reason == "error" else 503, f"generation {reason}", reason)
