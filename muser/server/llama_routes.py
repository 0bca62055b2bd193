"""llama.cpp-compatible routes: /completion, /apply-template, /tokenize, /detokenize, /health,
/props, /infill (501); /slots is in muser/server/slot_routes.py."""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from muser.core import SamplingParams, StepOutput
from muser.server import logit_bias, logprob_shapes
from muser.server.context import (
    ServerContext,
    check_progress,
    collect_outputs,
    sampling_or_400,
    with_defaults,
)
from muser.server.errors import ApiError, generation_failed
from muser.server.generation import Generation, GenerationStream, samples
from muser.server.logprob_shapes import Pieces
from muser.server.openai_routes import sse
from muser.server.protocol import (
    ApplyTemplateRequest,
    DetokenizeRequest,
    LlamaCompletionRequest,
    OnePrompt,
    PromptObject,
    TokenizeRequest,
    split_prompts,
)
from muser.server.results import is_truncated, stop_type, stopping_word, timings
from muser.server.samples import check_samples
from muser.server.structured import with_grammar

router = APIRouter()
health_router = APIRouter()


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


@health_router.get("/health")
@health_router.get("/v1/health")
async def health(request: Request) -> JSONResponse:
    if getattr(request.app.state, "draining", False):
        return JSONResponse({"status": "shutting down"}, status_code=503)
    ctx = request.app.state.startup.ctx
    if ctx is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    if ctx.loop.error is not None:
        return JSONResponse({"status": "error", "error": ctx.loop.error}, status_code=500)
    return JSONResponse({"status": "ok"})


@router.get("/props")
async def props(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    params = with_defaults(LlamaCompletionRequest(prompt=""), ctx).model_dump(
        exclude={"prompt", "model", "max_tokens", "max_completion_tokens", "grammar",
                 "json_schema", "logit_bias", "response_fields", "samplers", "lora",
                 "dry_sequence_breakers", "n", "n_cmpl"})
    if ctx.options.defaults.n_predict is not None:
        params["n_predict"] = ctx.options.defaults.n_predict
    return {"default_generation_settings": {"n_ctx": ctx.max_model_len, "params": params},
            "total_slots": ctx.max_num_seqs, "model_alias": ctx.model_name,
            "model_aliases": list(ctx.aliases), "model_tags": list(ctx.options.tags),
            "model_path": ctx.model_path, "chat_template": ctx.template.source,
            "build_info": "muser", "memory": _memory(ctx), "batching": ctx.batching,
            "is_sleeping": ctx.loop.asleep}


def _memory(ctx: ServerContext) -> dict[str, Any]:
    """Bytes per category (muser.memory) and the KV page pool."""
    stats = ctx.loop.stats
    m = stats.memory
    if m is None:
        return {}
    return {"bytes": m.categories(), "total_bytes": m.total,
            "workspace_basis": m.workspace_basis,
            "kv_pages": {"total": m.num_pages, "free": stats.num_free_pages,
                         "page_size": m.page_size}}


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    body = await ctx.read_body(request, TokenizeRequest)
    ids = await run_in_threadpool(ctx.tokenizer.encode, body.content, body.add_special,
                                  body.parse_special)
    if not body.with_pieces:
        return {"tokens": ids}
    pieces = [ctx.tokenizer.token_to_piece(t).decode("utf-8", "replace") for t in ids]
    return {"tokens": [{"id": t, "piece": p} for t, p in zip(ids, pieces)]}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    body = await ctx.read_body(request, DetokenizeRequest)
    await ctx.encode(body.tokens)
    return {"content": await run_in_threadpool(ctx.tokenizer.decode, body.tokens)}


@router.post("/completion")
@router.post("/completions")
async def completion(request: Request) -> Any:
    """One prompt -> one result object; several prompts, or n_cmpl samples of each -> a list
    of them, in order (result p * n_cmpl + i: prompt p's sample i, as llama-server numbers its
    child tasks)."""
    ctx = _ctx(request)
    body = with_defaults(await ctx.read_body(request, LlamaCompletionRequest), ctx)
    ctx.check_model(body.model)
    prompts = [await encode_prompt(ctx, p) for p in split_prompts(body.prompt)]
    if body.stream and len(prompts) > 1:
        raise ApiError(400, "prompt: a streamed request takes one prompt", "invalid_value",
                       "prompt")
    check_progress(body.return_progress, body.stream)
    if body.post_sampling_probs and not body.n_probs:
        raise ApiError(400, "post_sampling_probs: set n_probs (how many probabilities) with it",
                       "invalid_value", "post_sampling_probs")
    slot = ctx.slot(body.id_slot)
    ctx.check_shift(body.n_keep, body.n_discard)
    n = check_samples(ctx, body.num_samples, None, body.stream, "n_cmpl")
    bias = logit_bias.resolve(ctx.tokenizer, body.logit_bias, openai=False)
    given = bool({"n_predict", "max_tokens", "max_completion_tokens"} & body.model_fields_set)
    samplings = [await with_grammar(body, sampling_or_400(
        lambda m: body.sampling(m, ctx.max_model_len, slot, n),
        ctx.n_predict(body.num_predict, len(ids), given), bias), ctx.grammars)
        for ids in prompts]
    gens: list[Generation] = []
    try:
        for ids, sampling in zip(prompts, samplings):
            gens.append(ctx.start(ids, sampling, llama=True))
    except ApiError:
        for gen in gens:
            gen.close()
        raise
    if body.stream:
        return GenerationStream(gens[0], _events(ctx, body, gens[0], prompts[0], samplings[0]))
    outs = await asyncio.gather(*(collect_outputs(gen, request) for gen in gens))
    results = []
    for p, (gen, ids, sampling, out) in enumerate(zip(gens, prompts, samplings, outs)):
        if gen.finish_reason in ("error", "cancelled"):
            raise generation_failed(gen.finish_reason, gen.error)
        for i, sample in enumerate(samples(out, n)):
            text = "".join(o.text_delta for o in sample)
            tokens = [o.token_id for o in sample if o.token_id is not None]
            probs = {"completion_probabilities": logprob_shapes.llama(
                Pieces(ctx.tokenizer), [(o.token_id, o.logprobs) for o in sample
                                        if o.token_id is not None], body.post_sampling_probs)
                     } if body.n_probs else {}
            result = {"index": p * n + i, "content": text,
                      "tokens": tokens if body.return_tokens else [], **probs,
                      **_final(ctx, body, gen, ids, sampling, text, tokens,
                               sample[-1] if sample else None)}
            results.append(pick_fields(result, body.response_fields) if body.response_fields
                           else result)
        gen.record_finished()
    return results[0] if len(results) == 1 else results


async def encode_prompt(ctx: ServerContext, prompt: OnePrompt) -> list[int]:
    """One prompt as llama-server reads it (muser/server/protocol.py: split_prompts) -> ids."""
    if isinstance(prompt, PromptObject):
        return await ctx.encode(prompt.text)
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return await ctx.encode(prompt)
    if isinstance(prompt, list):
        return await ctx.encode_mixed(prompt)
    if isinstance(prompt, int):
        raise ApiError(400, "prompt: a token id alone is not a prompt; send [id]",
                       "invalid_value", "prompt")
    return await ctx.encode(prompt)


async def _events(ctx: ServerContext, body: LlamaCompletionRequest, gen: Generation,
                  prompt_ids: list[int], sampling: SamplingParams) -> AsyncIterator[str]:
    """Every token in a `stop: false` chunk (with n_probs, its completion_probabilities;
    with timings_per_token, the timings so far), with return_progress a chunk per prompt
    progress report before them, then one `stop: true` chunk with the final fields and no
    content (llama-server's framing); with n_cmpl each chunk's index names its sample, whose
    `stop: true` chunk comes as it finishes. A generation that fails ends with an error event
    instead."""
    parts: dict[int, list[str]] = defaultdict(list)
    tokens: dict[int, list[int]] = defaultdict(list)
    pieces = Pieces(ctx.tokenizer)
    async for out in gen.outputs():
        if out.finish_reason in ("error", "cancelled"):
            yield sse(generation_failed(out.finish_reason, out.error).body())
            return
        head = {"index": out.index, "stop": False, "id_slot": body.id_slot,
                **({"timings": timings(gen)} if body.timings_per_token else {})}
        if out.progress is not None:
            yield sse({**head, "content": "", "tokens": [], "tokens_predicted": 0,
                       "tokens_evaluated": gen.num_prompt,
                       "prompt_progress": gen.prompt_progress()})
            continue
        ids = [] if out.token_id is None else [out.token_id]
        parts[out.index].append(out.text_delta)
        tokens[out.index] += ids
        if ids or out.text_delta:
            probs = {"completion_probabilities": logprob_shapes.llama(
                pieces, [(i, out.logprobs) for i in ids], body.post_sampling_probs)
                     } if body.n_probs else {}
            yield sse({**head, "content": out.text_delta, "tokens": ids, **probs})
        if out.finished:
            text = "".join(parts[out.index])
            yield sse({"index": out.index, "content": "", "tokens": [],
                       **_final(ctx, body, gen, prompt_ids, sampling, text, tokens[out.index],
                                out)})
    gen.record_finished()


def _final(ctx: ServerContext, body: LlamaCompletionRequest, gen: Generation,
           prompt_ids: list[int], sampling: SamplingParams, text: str,
           tokens: list[int], last: StepOutput | None) -> dict[str, Any]:
    """One sample's final fields; `last`: its last output. Its timings are the request's (the
    prompt's, and every sample's tokens)."""
    kind = stop_type(last)
    word = stopping_word(text, ctx.tokenizer.decode(tokens), sampling.stop) if (
        kind == "word") else ""
    if kind == "word" and not word:
        kind = "eos"  # NOTE: the grammar ended it (llama.cpp's grammar ends with an EOS)
    return {"id_slot": body.id_slot, "stop": True, "model": ctx.model_name,
            "tokens_predicted": len(tokens), "tokens_evaluated": gen.num_prompt,
            "generation_settings": generation_settings(ctx, body, sampling),
            "prompt": ctx.tokenizer.decode(prompt_ids), "has_new_line": "\n" in text,
            "truncated": is_truncated(gen.num_prompt, len(tokens), ctx.max_model_len),
            "stop_type": kind, "stopping_word": word,
            "tokens_cached": gen.num_prompt + len(tokens), "timings": timings(gen)}


def generation_settings(ctx: ServerContext, body: LlamaCompletionRequest,
                        sampling: SamplingParams) -> dict[str, Any]:
    """The settings a request ran with, in llama-server's names. ignore_eos shows as a -inf
    (null) bias on each end-of-generation token, as llama-server reports it."""
    eog = sorted(ctx.tokenizer.eot_ids) if sampling.ignore_eos else []
    # NOTE: -inf shows as null (JSON has no infinity), as llama-server shows it
    biases = [{"token": t, "bias": b if b > -math.inf else None} for t, b in sampling.logit_bias]
    return {"n_predict": sampling.max_tokens, "seed": -1 if sampling.seed is None else
            sampling.seed, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "min_p": sampling.min_p,
            "repeat_penalty": sampling.repeat_penalty, "repeat_last_n": sampling.repeat_last_n,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "stop": list(sampling.stop), "ignore_eos": sampling.ignore_eos,
            "logit_bias": [{"token": t, "bias": None} for t in eog] + biases,
            "n_probs": body.n_probs, "post_sampling_probs": body.post_sampling_probs,
            "timings_per_token": body.timings_per_token,
            "return_progress": body.return_progress,
            "stream": body.stream, "cache_prompt": body.cache_prompt}


def pick_fields(result: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """response_fields: each 'a/b' path that exists, as a top-level key."""
    picked = {}
    for path in paths:
        node: Any = result
        for key in path.split("/"):
            node = node.get(key, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            picked[path] = node
    return picked


_MISSING = object()


@router.post("/apply-template")
async def apply_template(request: Request) -> dict[str, str]:
    ctx = _ctx(request)
    body = await ctx.read_body(request, ApplyTemplateRequest)
    return {"prompt": await ctx.render_chat(body.chat(), body.add_generation_prompt,
                                            body.tools)}


@router.post("/infill")
async def infill() -> None:
    raise ApiError(501, "/infill needs fill-in-the-middle tokens, which this model (Gemma 3) "
                   "does not have", "not_supported")
