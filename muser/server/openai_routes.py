"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request

from muser.constraint import GrammarError
from muser.core import StepOutput
from muser.server import logit_bias, logprob_shapes
from muser.server.context import (
    ServerContext,
    check_progress,
    is_llama_path,
    sampling_or_400,
    with_defaults,
)
from muser.server.errors import ApiError, generation_failed
from muser.server.generation import Generation, GenerationStream, samples
from muser.server.logprob_shapes import Entry, Pieces
from muser.server.protocol import ChatRequest, CompletionRequest
from muser.server.results import timings
from muser.server.samples import best, check_samples, prompt_entries, split
from muser.server.structured import with_grammar
from muser.server.tool_calls import ToolPlan, choose_format, conversation, plan
from muser.server.tool_replies import StreamReader, message, sample_text

router = APIRouter()

_DEFAULT_COMPLETION_TOKENS = 16


def _package_version() -> str:
    """The installed distribution's version; a source tree on sys.path, not installed, has
    none and says so in the fingerprint."""
    try:
        return version("muser")
    except PackageNotFoundError:
        return "0+source"


SYSTEM_FINGERPRINT = f"b{_package_version()}-muser"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def chunks_of(events: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's SSE events (sse's) -> its chunks, up to [DONE] (the Messages and
    Responses routes translate them)."""
    async for event in events:
        data = event.removeprefix("data: ").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def _usage(*gens: Generation) -> dict[str, Any]:
    """Every prompt once, every sample's tokens; with speculative decoding, the draft tokens
    accepted and rejected (OpenAI's names for predicted tokens)."""
    num_prompt = sum(g.num_prompt for g in gens)
    num_output = sum(g.num_output for g in gens)
    drafted, accepted = sum(g.num_drafted for g in gens), sum(g.num_accepted for g in gens)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": sum(g.num_cached for g in gens)},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted}}


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": 0,
                                        "owned_by": "muser", "aliases": list(ctx.aliases),
                                        "tags": list(ctx.options.tags)}]}


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    """One prompt, or a list of them (text or token ids; choice p * n + i is prompt p's
    sample i; a stream takes one prompt)."""
    ctx = _ctx(request)
    body = with_defaults(await ctx.read_body(request, CompletionRequest), ctx)
    ctx.check_model(body.model)
    prompts = body.prompt if isinstance(body.prompt, list) and isinstance(
        body.prompt[0], (str, list)) else [body.prompt]
    if body.stream and len(prompts) > 1:
        raise ApiError(400, "prompt: a streamed request takes one prompt", "invalid_value",
                       "prompt")
    all_ids = [await ctx.encode(p) for p in prompts]
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens: 0 only with echo (the prompt's logprobs)",
                       "invalid_value", "max_tokens")
    n = 0 if body.max_tokens == 0 else ctx.max_tokens(
        body.max_tokens, _DEFAULT_COMPLETION_TOKENS, "max_tokens")
    if body.n_predict is not None:
        n = ctx.n_predict(body.n_predict, max(len(ids) for ids in all_ids))
    num_samples = check_samples(ctx, body.n, body.best_of, body.stream)
    k = body.logprobs
    # NOTE: ranking best_of samples needs their tokens' logprobs, asked for or not
    wanted = k if k is not None or num_samples == body.n else 0
    # NOTE: max_tokens 0 finishes when the prompt's logprobs are in, asked for or not
    echo_k = (k if k is not None else 0 if body.max_tokens == 0 else None) if body.echo else None
    llama = is_llama_path(request)
    bias = logit_bias.resolve(ctx.tokenizer, body.logit_bias, openai=not llama)
    sampling = await with_grammar(body, sampling_or_400(
        lambda m: body.sampling(m, num_samples, wanted, echo_k), n, bias), ctx.grammars)
    gens: list[Generation] = []
    try:
        for ids in all_ids:
            gens.append(ctx.start(ids, sampling, llama))
    except ApiError:
        for gen in gens:
            gen.close()
        raise
    head = _head(ctx, f"cmpl-{gens[0].uid}", "text_completion")
    pieces = Pieces(ctx.tokenizer)
    echoed = [(p if isinstance(p, str) else ctx.tokenizer.decode(ids)) if body.echo else ""
              for p, ids in zip(prompts, all_ids)]

    def choice(index: int, text: str, entries: list[Entry], reason: str | None,
               offset: int = 0) -> dict[str, Any]:
        lps = None if k is None else logprob_shapes.completion(pieces, entries, offset)
        return {"index": index, "text": text, "logprobs": lps, "finish_reason": reason}

    if body.stream:
        ids = all_ids[0]

        def content(out: StepOutput, first: bool, offsets: dict[int, int]) -> dict[str, Any]:
            entries = [(out.token_id, out.logprobs)] if out.token_id is not None else []
            text = out.text_delta
            if first and body.echo:
                entries, text = prompt_entries(ids, [out]) + entries, echoed[0] + text
            offset = offsets.get(out.index, 0)
            offsets[out.index] = offset + sum(len(pieces(t)[0]) for t, _ in entries)
            return [choice(out.index, text, entries, None, offset)]

        return _stream(ctx, gens[0], head, body.include_usage, llama, content,
                       lambda index, reason: [choice(index, "", [], reason)], None,
                       always=k is not None or body.echo)
    results = await asyncio.gather(*(gen.collect(request) for gen in gens))
    choices = []
    for p, (gen, ids, result) in enumerate(zip(gens, all_ids, results)):
        _raise_if_failed(gen)
        gen.record_finished()
        echo_entries = prompt_entries(ids, result.outputs) if body.echo else []
        chosen = best(split(result.outputs, num_samples), body.n)
        choices += [choice(p * body.n + i, echoed[p] + s.text, echo_entries + s.entries,
                           s.finish_reason) for i, s in enumerate(chosen)]
    return {**head, "usage": _usage(*gens), "choices": choices}


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(request: Request) -> Any:
    ctx = _ctx(request)
    body = await ctx.read_body(request, ChatRequest)
    return await chat(ctx, body, request, is_llama_path(request))


async def chat(ctx: ServerContext, body: ChatRequest, request: Request, llama: bool
               ) -> dict[str, Any] | GenerationStream:
    """One chat request -> the chat.completion object, or its chunks' stream; llama:
    llama-server's dialect (muser/server/context.py is_llama_path). The other APIs' routes
    (messages_routes.py, responses_routes.py) translate to and from this."""
    body = with_defaults(body, ctx)
    ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: set logprobs to true with it", "invalid_value",
                       "top_logprobs")
    k = (body.top_logprobs or 0) if body.logprobs else None
    check_progress(body.return_progress, body.stream)
    slot = ctx.slot(body.id_slot)
    tools = _tool_plan(ctx, body)
    prompt = await _chat_prompt(ctx, body, llama, tools)
    ids = await ctx.encode(prompt)
    n = ctx.n_predict(body.n_predict, len(ids)) if body.n_predict is not None else (
        ctx.max_tokens(body.max_completion_tokens or body.max_tokens, ctx.max_model_len,
                       "max_tokens"))
    num_samples = check_samples(ctx, body.n, None, body.stream)
    bias = logit_bias.resolve(ctx.tokenizer, body.logit_bias, openai=not llama)
    sampling = await with_grammar(body, sampling_or_400(
        lambda m: dataclasses.replace(body.sampling(m, num_samples, k), slot=slot,
                                      progress=body.return_progress), n, bias), ctx.grammars)
    sampling = await _with_tool_grammar(ctx, tools, sampling)
    gen = ctx.start(ids, sampling, llama)
    head = _head(ctx, f"chatcmpl-{gen.uid}", "chat.completion.chunk")
    pieces = Pieces(ctx.tokenizer)

    def lps(entries: list[Entry]) -> dict[str, Any] | None:
        return None if k is None else logprob_shapes.chat(pieces, entries)

    if body.stream:
        readers = {i: StreamReader(tools, ctx.tokenizer) for i in range(num_samples)}

        def content(out: StepOutput, first: bool, offsets: dict[int, int]
                    ) -> list[dict[str, Any]]:
            entries = [(out.token_id, out.logprobs)] if out.token_id is not None else []
            deltas = readers[out.index].feed(out) if tools.parses else [
                {"content": out.text_delta}]
            if not deltas and entries and k is not None:
                deltas = [{}]  # NOTE: the token's logprobs, its text held back
            return [{"index": out.index, "delta": d, "logprobs": lps(entries) if j == 0 else None,
                     "finish_reason": None} for j, d in enumerate(deltas)]

        def finish(index: int, reason: str) -> list[dict[str, Any]]:
            reader = readers[index]
            rest = reader.finish() if tools.parses else []
            if reader.made_calls and reason == "stop":
                reason = "tool_calls"
            return [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
                    for d in rest] + [{"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": reason}]

        # NOTE: the role chunk's content is null, as llama-server sends it (OpenAI sends "")
        first = [{"index": i, "delta": {"role": "assistant", "content": None},
                  "logprobs": None, "finish_reason": None} for i in range(num_samples)]
        return _stream(ctx, gen, head, body.include_usage, llama, content, finish, first,
                       always=k is not None or tools.parses, per_token=body.timings_per_token)
    result = await gen.collect(request)
    _raise_if_failed(gen)
    gen.record_finished()
    extra = {"__verbose": {"prompt": prompt}} if body.verbose or ctx.options.verbose else {}
    if body.timings_per_token:
        extra["timings"] = timings(gen)
    outputs = samples(result.outputs, num_samples)
    choices = []
    for i, s in enumerate(split(result.outputs, num_samples)):
        reply, reason = {"role": "assistant", "content": s.text}, s.finish_reason
        if tools.parses:
            reply, called = message(tools, sample_text(outputs[i], ctx.tokenizer,
                                                       tools.format.special_text))
            reason = "tool_calls" if called and reason == "stop" else reason
        choices.append({"index": i, "message": reply, "logprobs": lps(s.entries),
                        "finish_reason": reason})
    return {**head, "object": "chat.completion", "usage": _usage(gen), "choices": choices,
            **extra}


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")
async def chat_input_tokens(request: Request) -> dict[str, int]:
    """How many tokens the conversation's prompt takes (nothing is generated)."""
    ctx = _ctx(request)
    body = await ctx.read_body(request, ChatRequest)
    return {"input_tokens": len(await chat_prompt_ids(ctx, body, is_llama_path(request)))}


async def chat_prompt_ids(ctx: ServerContext, body: ChatRequest, llama: bool) -> list[int]:
    """The token ids of the conversation's prompt, as chat() would run it."""
    return await ctx.encode(await _chat_prompt(ctx, body, llama, _tool_plan(ctx, body)))


def _tool_plan(ctx: ServerContext, body: ChatRequest) -> ToolPlan:
    return plan(body, choose_format(ctx.template.source, ctx.options.tool_call_parser))


async def _with_tool_grammar(ctx: ServerContext, tools: ToolPlan, sampling: Any) -> Any:
    """sampling held to the calls' grammar, when the plan has one. Each function's schema is
    checked as a response_format schema is (its own first mask: the calls' grammar reaches a
    schema only once a call opens), then the whole grammar; one that does not compile or
    costs too much is a 400 on tools."""
    grammar = tools.grammar()
    if grammar is None:
        return sampling
    what = "the calls' grammar"
    try:
        for f in tools.functions:
            what = f"function {f.name!r}'s parameters"
            await ctx.grammars.check("schema", f.parameters)
        what = "the calls' grammar"
        text = await ctx.grammars.check("grammar", grammar)
    except GrammarError as exc:
        raise ApiError(400, f"tools: {what} cannot be compiled: {exc}", "invalid_value",
                       "tools") from None
    return dataclasses.replace(sampling, grammar=text)


async def _chat_prompt(ctx: ServerContext, body: ChatRequest, llama: bool,
                       tools: ToolPlan) -> str:
    """The rendered conversation. Off /v1/* a final assistant message is continued (llama-server's
    prefill); on /v1/* only when continue_final_message asks."""
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(400, "continue_final_message: set add_generation_prompt to false with it",
                       "invalid_value", "continue_final_message")
    messages, offered = conversation(body, tools)
    prefill = llama and body.add_generation_prompt and messages[-1]["role"] == "assistant"
    if prefill and len(messages) > 1 and messages[-2]["role"] == "assistant":
        raise ApiError(400, "Cannot have 2 or more assistant messages at the end of the list "
                       "(the last one is continued)", "invalid_value", "messages")
    continued = body.continue_final_message or prefill
    thinking = body.chat_template_kwargs.enable_thinking if body.chat_template_kwargs else None
    return await ctx.render_chat(messages, body.add_generation_prompt and not continued,
                                 offered, continue_final_message=continued, thinking=thinking)


def _head(ctx: ServerContext, uid: str, kind: str) -> dict[str, Any]:
    return {"id": uid, "object": kind, "created": int(time.time()), "model": ctx.model_name,
            "system_fingerprint": SYSTEM_FINGERPRINT}


def _stream(ctx: ServerContext, gen: Generation, head: dict[str, Any], include_usage: bool,
            llama: bool,
            content: Callable[[StepOutput, bool, dict[int, int]], list[dict[str, Any]]],
            finish: Callable[[int, str], list[dict[str, Any]]], first: list[dict[str, Any]] | None,
            always: bool = False, per_token: bool = False) -> GenerationStream:
    """[first chunks], with prompt progress asked a chunk per report (the first chunks'
    delta again, with prompt_progress, as llama-server sends it), the chunks `content` makes of
    each output with a text delta (of each output with `always`: logprobs, echo or a reply
    parser), the chunks `finish` makes as each sample finishes, its reason in the last (the choice's index tells the samples apart), [usage
    (with llama-server's timings off /v1/* or with `per_token`)], [DONE]; `per_token`: every
    chunk after the first ones carries the timings so far. A generation that fails ends the
    stream with an error event instead (no [DONE])."""
    def with_timings(chunk: dict[str, Any]) -> dict[str, Any]:
        return {**chunk, "timings": timings(gen)} if per_token else chunk

    async def events() -> AsyncIterator[str]:
        for chunk in first or []:
            yield sse({**head, "choices": [chunk]})
        seen: set[int] = set()
        offsets: dict[int, int] = {}
        async for out in gen.outputs():
            if out.finish_reason in ("error", "cancelled"):
                yield sse(generation_failed(out.finish_reason, out.error).body())
                return
            if out.progress is not None:
                yield sse(with_timings({**head, "choices": (first or [])[:1],
                                        "prompt_progress": gen.prompt_progress()}))
                continue
            is_first = out.index not in seen
            seen.add(out.index)
            if out.text_delta or (always and (out.token_id is not None or is_first)):
                for chunk in content(out, is_first, offsets):
                    yield sse(with_timings({**head, "choices": [chunk]}))
            if out.finished:
                for chunk in finish(out.index, out.finish_reason):
                    yield sse(with_timings({**head, "choices": [chunk]}))
        gen.record_finished()
        if include_usage:
            usage = {**head, "choices": [], "usage": _usage(gen)}
            yield sse({**usage, "timings": timings(gen)} if llama or per_token else usage)
        yield "data: [DONE]\n\n"

    return GenerationStream(gen, events())


def _raise_if_failed(gen: Generation) -> None:
    if gen.finish_reason in ("error", "cancelled"):
        raise generation_failed(gen.finish_reason, gen.error)
