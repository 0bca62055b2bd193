"""Embeddings: /v1/embeddings (OpenAI's shape) and /embedding, /embeddings (llama-server's), on
a server started with --embedding.

Each prompt is one engine request (SamplingParams.embed: the server's --pooling), prefilled
like a completion's prompt and sampling nothing; its one output carries the pooled final hidden
states (muser/engine/embedding.py). Here they are normalized as llama-server's embd_normalize
asks (default 2: unit euclidean length, as OpenAI's embeddings are) and shaped:

    /v1/embeddings   {"object": "list", "data": [{"object": "embedding", "index", "embedding":
                     floats | base64 of float32}], "model", "usage": {prompt_tokens,
                     total_tokens}}; pooling none is refused (one vector per input is the shape)
    /embedding       [{"index", "embedding": [vector, ...]}]: one vector, or with pooling none
                     one per prompt token, not normalized (as llama-server returns them)
"""

from __future__ import annotations

import asyncio
import base64
import math
import sys
from array import array
from typing import Any

from fastapi import APIRouter, Request

from muser.core import SamplingParams
from muser.server.context import ServerContext, collect_outputs
from muser.server.errors import ApiError, generation_failed
from muser.server.generation import Generation
from muser.server.llama_routes import encode_prompt
from muser.server.protocol import EmbeddingRequest, split_prompts

router = APIRouter()

INT16_RANGE = 32760.0  # llama-server's max-abs normalization maps the largest |x| to this


@router.post("/v1/embeddings")
async def embeddings_openai(request: Request) -> Any:
    return await _embeddings(request, openai=True)


@router.post("/embedding")
@router.post("/embeddings")
async def embeddings_llama(request: Request) -> Any:
    return await _embeddings(request, openai=False)


async def _embeddings(request: Request, openai: bool) -> Any:
    ctx: ServerContext = request.app.state.ctx
    pooling = ctx.options.pooling
    if pooling is None:
        raise ApiError(501, "This server does not support embeddings. Start it with "
                       "`--embedding`", "not_supported")
    if openai and pooling == "none":
        raise ApiError(400, "Pooling type 'none' is not OAI compatible. Please use a different "
                       "pooling type (this server runs with --pooling none: start it with "
                       "--pooling mean, last or cls, or ask /embedding)", "invalid_value")
    body = await ctx.read_body(request, EmbeddingRequest)
    ctx.check_model(body.model)
    if (body.input is None) == (body.content is None):
        raise ApiError(400, "input: give the prompts as \"input\" (or as \"content\", "
                       "llama-server's name), once", "invalid_value", "input")
    openai = openai and body.input is not None  # NOTE: "content" asks llama-server's shape
    if body.dimensions is not None and body.dimensions != ctx.hidden_size:
        raise ApiError(400, f"dimensions: this model's embeddings have {ctx.hidden_size} "
                       "dimensions and are not shortened; send that or leave it out",
                       "invalid_value", "dimensions")
    if not openai and body.encoding_format != "float":
        raise ApiError(400, "encoding_format: base64 is a /v1/embeddings format",
                       "invalid_value", "encoding_format")
    prompts = [await encode_prompt(ctx, p)
               for p in split_prompts(body.input if body.input is not None else body.content)]
    for ids in prompts:  # NOTE: every prompt checked before any starts
        if len(ids) >= ctx.max_model_len:
            raise ctx.overflow(len(ids), llama=not openai)
    vectors = await _run(ctx, request, prompts, SamplingParams(max_tokens=0, embed=pooling),
                         llama=not openai)
    if pooling != "none":
        vectors = [[normalize(v, body.embd_normalize) for v in vs] for vs in vectors]
    if not openai:
        return [{"index": i, "embedding": vs} for i, vs in enumerate(vectors)]
    return {"object": "list", "model": ctx.model_name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encoded(vs[0], body.encoding_format)}
                     for i, vs in enumerate(vectors)],
            "usage": {"prompt_tokens": sum(map(len, prompts)),
                      "total_tokens": sum(map(len, prompts))}}


async def _run(ctx: ServerContext, request: Request, prompts: list[list[int]],
               sampling: SamplingParams, llama: bool) -> list[list[list[float]]]:
    """Every prompt's vectors, at most --max-num-seqs of the request's prompts in the engine at
    once (so a long list waits its turn here, not in the server's queue)."""
    room = asyncio.Semaphore(ctx.max_num_seqs)

    async def one(ids: list[int]) -> list[list[float]]:
        async with room:
            gen: Generation = ctx.start(ids, sampling, llama)
            outs = await collect_outputs(gen, request)
            if gen.finish_reason in ("error", "cancelled") or not outs:
                raise generation_failed(gen.finish_reason or "cancelled", gen.error)
            gen.record_finished()
            return [array("f", v).tolist() for v in outs[-1].embedding]

    tasks = [asyncio.ensure_future(one(ids)) for ids in prompts]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def normalize(vector: list[float], norm: int) -> list[float]:
    """llama-server's embd_normalize, the result rounded to float32: -1 as it is, 0 scaled so
    the largest |x| is INT16_RANGE, 2 unit euclidean length, 1 or p > 2 unit p-norm; a zero
    vector stays zero."""
    if norm == -1:
        return vector
    if norm == 0:
        size = max(map(abs, vector)) / INT16_RANGE
    elif norm == 2:
        size = math.sqrt(math.fsum(x * x for x in vector))
    else:
        size = math.fsum(abs(x) ** norm for x in vector) ** (1.0 / norm)
    scale = 1.0 / size if size > 0 else 0.0
    return array("f", [x * scale for x in vector]).tolist()


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encoding_format: the floats, or base64 of their float32 bytes (little-endian)."""
    if encoding_format == "float":
        return vector
    packed = array("f", vector)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")
