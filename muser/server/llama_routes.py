"""llama.cpp-compatible routes: /completion, /tokenize, /detokenize, /health, /props, /slots."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from muser.core import StepOutput
from muser.server.context import ServerContext, sampling_or_400
from muser.server.errors import ApiError
from muser.server.generation import Generation, GenerationStream
from muser.server.openai_routes import sse
from muser.server.protocol import DetokenizeRequest, LlamaCompletionRequest, TokenizeRequest

router = APIRouter()
admin_router = APIRouter()
health_router = APIRouter()


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


@health_router.get("/health")
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
    defaults = LlamaCompletionRequest(prompt="").model_dump(exclude={"prompt"})
    return {"default_generation_settings": {"n_ctx": ctx.max_model_len, "params": defaults},
            "total_slots": ctx.max_num_seqs, "model_alias": ctx.model_name,
            "model_path": ctx.model_path, "chat_template": ctx.tokenizer.chat_template or "",
            "build_info": "muser", "memory": _memory(ctx), "batching": ctx.batching}


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
    ids = await run_in_threadpool(ctx.tokenizer.encode, body.content, body.add_special)
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
async def completion(request: Request) -> Any:
    ctx = _ctx(request)
    body = await ctx.read_body(request, LlamaCompletionRequest)
    ids = await ctx.encode(body.prompt)
    limit = max(1, ctx.max_model_len - len(ids))
    n = ctx.max_tokens(None if body.n_predict < 0 else body.n_predict, limit, "n_predict")
    gen = ctx.start(ids, sampling_or_400(body.sampling, n))
    if body.stream:
        return GenerationStream(gen, _events(ctx, gen))
    result = await gen.collect(request)
    if result.finish_reason in ("error", "cancelled"):
        raise ApiError(500, f"generation {result.finish_reason}", result.finish_reason)
    return {"content": result.text, **_final(ctx, gen, _stop_type(gen.last))}


async def _events(ctx: ServerContext, gen: Generation) -> AsyncIterator[str]:
    async for out in gen.outputs():
        if out.finish_reason in ("error", "cancelled"):
            yield sse(ApiError(500, f"generation {out.finish_reason}").body())
            return
        tokens = [] if out.token_id is None else [out.token_id]
        chunk = {"content": out.text_delta, "tokens": tokens, "stop": False}
        if out.finished:
            chunk.update(_final(ctx, gen, _stop_type(out)))
        yield sse(chunk)


def _stop_type(out: StepOutput | None) -> str:
    if out is None or out.finish_reason == "length":
        return "limit"
    return "eos" if out.token_id is None else "word"


def _final(ctx: ServerContext, gen: Generation, stop_type: str) -> dict[str, Any]:
    return {"stop": True, "model": ctx.model_name, "tokens_predicted": gen.num_output,
            "tokens_evaluated": gen.num_prompt, "stop_type": stop_type, "truncated": False,
            "timings": gen.timings()}


@admin_router.get("/slots")
async def slots(request: Request) -> list[dict[str, Any]]:
    ctx = _ctx(request)
    by_slot = {s.slot: s for s in ctx.loop.stats.slots if s.slot is not None}
    out = []
    for i in range(ctx.max_num_seqs):
        s = by_slot.get(i)
        out.append({"id": i, "id_task": s.uid if s else -1, "is_processing": s is not None,
                    "n_ctx": ctx.max_model_len, "state": s.status if s else "idle",
                    "n_prompt_tokens": s.num_prompt if s else 0,
                    "n_past": s.num_cached if s else 0, "n_decoded": s.num_output if s else 0})
    return out


@admin_router.post("/slots/{slot_id}")
async def slot_action(request: Request, slot_id: int, action: str) -> dict[str, Any]:
    """action=erase cancels the request in the slot and frees its KV."""
    ctx = _ctx(request)
    if action != "erase":
        raise ApiError(400, "only action=erase is supported", "invalid_value", "action")
    if not 0 <= slot_id < ctx.max_num_seqs:
        raise ApiError(404, f"no slot {slot_id}", "not_found", "id_slot")
    held = [s for s in ctx.loop.stats.slots if s.slot == slot_id]
    for s in held:
        ctx.loop.abort(s.uid)
    return {"id_slot": slot_id, "n_erased": sum(s.num_cached for s in held)}
