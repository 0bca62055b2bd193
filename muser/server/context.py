"""ServerContext: what every route needs, plus body parsing and request admission."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from jinja2.exceptions import TemplateError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from muser.core import PromptError, SamplingParams, StepOutput, check_prompt
from muser.errors import MuserError
from muser.scheduler import QueueFull
from muser.server.auth import Keys
from muser.server.engine_process import EngineDead, EngineProcess
from muser.server.errors import ApiError
from muser.server.generation import Generation
from muser.server.grammar_check import GrammarCheck
from muser.server.metrics import Metrics
from muser.server.options import ServerOptions
from muser.server.templates import ChatTemplate
from muser.tokenizer import Tokenizer

log = logging.getLogger("muser.server")

_DISCONNECT_POLL_S = 0.25
MAX_TOKENS = 2**31 - 1  # n_predict -1 with --context-shift: no limit but the end of the turn

BodyT = TypeVar("BodyT", bound=BaseModel)


@dataclass
class ServerContext:
    loop: EngineProcess
    tokenizer: Tokenizer
    metrics: Metrics
    keys: Keys
    model_name: str
    model_path: str
    max_model_len: int
    max_num_seqs: int
    max_body_bytes: int = 4 << 20
    hidden_size: int = 0  # the model's: an embedding's dimensions
    context_shift: bool = False  # --context-shift: a full context drops its oldest half
    batching: dict[str, Any] = field(default_factory=dict)
    options: ServerOptions = field(default_factory=ServerOptions)

    def __post_init__(self) -> None:
        """model_name: 'name[,alias...]' -> the name; every one is in `aliases`."""
        self.aliases = tuple(n.strip() for n in self.model_name.split(",") if n.strip())
        self.model_name = self.aliases[0]
        self.grammars = GrammarCheck(self.tokenizer, self.options.grammar_limits)
        try:
            self.template = ChatTemplate(self.tokenizer, self.options.chat_template,
                                         self.options.thinking)
        except TemplateError as exc:
            raise MuserError(f"the chat template does not parse: {exc}") from None

    async def read_body(self, request: Request, model: type[BodyT]) -> BodyT:
        """Size-limited, strict JSON sent as application/json -> `model`; any problem is a
        4xx ApiError (a client gone mid-body: one log line, and nothing was started)."""
        return validate(model, await self.read_json(request))

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as read_body reads it, a JSON object not yet validated."""
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        data = bytearray()
        try:
            async for chunk in request.stream():
                data += chunk
                if len(data) > self.max_body_bytes:
                    raise _too_large(self.max_body_bytes)
        except ClientDisconnect:
            peer = f"{request.client.host}:{request.client.port}" if request.client else "?"
            log.info("%s %s from %s: the client went away after %d bytes of the body",
                     request.method, request.url.path, peer, len(data))
            raise ApiError(400, "the body ended early: the client disconnected",
                           "client_disconnected") from None
        _check_json_type(request.headers.get("content-type", ""))
        try:
            obj = json.loads(bytes(data).decode("utf-8"), parse_constant=_reject_constant)
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeError:
            raise ApiError(400, "the body is not valid UTF-8", "invalid_encoding") from None
        except RecursionError:
            raise ApiError(400, "the body is nested too deeply", "invalid_json") from None
        except ValueError as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "the body must be a JSON object", "invalid_json")
        return obj

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          tools: list[dict[str, Any]] | None = None,
                          continue_final_message: bool = False,
                          thinking: bool | None = None) -> str:
        """The conversation through the chat template; one it refuses is a 400 on messages."""
        try:
            return await run_in_threadpool(self.template.render, messages, add_generation_prompt,
                                           tools, continue_final_message, thinking)
        except Exception as exc:  # noqa: BLE001 (a template may raise anything)
            raise ApiError(400, f"cannot apply the chat template: {exc}", "invalid_value",
                           "messages") from None

    def check_model(self, name: str | None) -> None:
        """One model served: any name passes, unless --strict-model-name."""
        if name and self.options.strict_model_name and name not in self.aliases:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                           f"'{self.model_name}'.", "model_not_found", "model")

    async def encode(self, prompt: str | list[int]) -> list[int]:
        """Text (BOS added, specials parsed) or token ids (range-checked) -> ids."""
        if isinstance(prompt, list):
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"token ids must be in [0, {vocab})", "invalid_value",
                               "prompt")
            return prompt
        return await run_in_threadpool(self.tokenizer.encode, prompt)

    async def encode_mixed(self, parts: list[int | str]) -> list[int]:
        """Ids and texts in one sequence, as llama-server joins them: a text gets BOS only as
        the first part."""
        ids: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                ids += await run_in_threadpool(self.tokenizer.encode, part, i == 0)
            else:
                ids += await self.encode([part])
        return ids

    def slot(self, id_slot: int) -> int | None:
        """llama-server's id_slot -> the slot to pin the request to (None: -1, any free one);
        one outside 0 .. max_num_seqs - 1 is a 400 naming the range."""
        if id_slot == -1:
            return None
        if not 0 <= id_slot < self.max_num_seqs:
            raise ApiError(400, f"id_slot: {id_slot} is not a slot of this server: -1 (any) or "
                           f"0 to {self.max_num_seqs - 1} (--max-num-seqs)", "invalid_value",
                           "id_slot")
        return id_slot

    def max_tokens(self, requested: int | None, default: int, param: str) -> int:
        """OpenAI's max_tokens: more than the context is refused (unless --context-shift);
        unset -> --n-predict or `default`."""
        if requested is not None and requested > self.max_model_len and not self.context_shift:
            raise ApiError(400, f"{param} must be <= {self.max_model_len} (the context length)",
                           "invalid_value", param)
        server = self.options.defaults.n_predict
        return requested or (server if server and server > 0 else default)

    def n_predict(self, requested: int, num_prompt: int, given: bool = True) -> int:
        """llama-server's n_predict: --n-predict when the request leaves it out (`given`
        false), then -1 or more than fits is capped at the context's rest; with
        --context-shift, which makes room as it goes, nothing is capped (-1: no limit but the
        end of the turn, as in llama-server)."""
        rest = max(1, self.max_model_len - num_prompt)
        server = self.options.defaults.n_predict
        if not given and server:
            requested = server
        if self.context_shift:
            return MAX_TOKENS if requested < 0 else requested
        return rest if requested < 0 else min(requested, rest)

    def check_shift(self, n_keep: int, n_discard: int) -> None:
        """n_keep and n_discard act through a context shift: without --context-shift only the
        values that change nothing (n_keep -1 or 0, n_discard 0) pass."""
        if self.context_shift:
            return
        for name, value, neutral in (("n_keep", n_keep, (-1, 0)), ("n_discard", n_discard, (0,))):
            if value not in neutral:
                raise ApiError(400, f"{name}: acts when a context shift drops tokens; this "
                               "server runs without --context-shift", "invalid_value", name)

    def start(self, prompt_ids: list[int], sampling: SamplingParams,
              llama: bool = False) -> Generation:
        """The prompt checked (the one check of its length on the server path), then
        submitted; llama: a prompt over the context gets llama-server's error shape."""
        try:
            check_prompt(prompt_ids, self.max_model_len)
        except PromptError as exc:
            if prompt_ids:
                raise self.overflow(len(prompt_ids), llama) from None
            raise ApiError(400, str(exc), "invalid_value", "prompt") from None
        try:
            return Generation(self.loop, self.metrics, prompt_ids, sampling)
        except EngineDead as exc:
            raise ApiError(503, f"the engine is not running ({exc}); see the server log",
                           "engine_dead") from None
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy ({exc}); retry later",
                           "rate_limit_exceeded", headers={"Retry-After": "1"}) from None

    def overflow(self, num_prompt: int, llama: bool) -> ApiError:
        if llama:
            return ApiError(400, "the request exceeds the available context size, try "
                            "increasing it", "context_length_exceeded", "prompt",
                            kind="exceed_context_size_error",
                            extra={"n_prompt_tokens": num_prompt, "n_ctx": self.max_model_len})
        return ApiError(400, f"the prompt has {num_prompt} tokens, too large: the context holds "
                        f"{self.max_model_len} (prompt + at least one new token)",
                        "context_length_exceeded", "prompt")


def validate(model: type[BodyT], obj: dict[str, Any]) -> BodyT:
    """A JSON object -> `model`; the first problem is a 400 naming its field."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"{param}: {_MESSAGES.get(err['type'], err['msg'])}",
                       "invalid_value", param) from None


def check_progress(return_progress: bool, stream: bool) -> None:
    """return_progress reports come as stream chunks: without stream it is a 400."""
    if return_progress and not stream:
        raise ApiError(400, "return_progress: prompt progress comes in stream chunks; set "
                       "stream to true with it", "invalid_value", "return_progress")


def with_defaults(body: BodyT, ctx: ServerContext) -> BodyT:
    """The server's --temp / --seed where the request left them out."""
    d = ctx.options.defaults
    given = {"temperature": d.temperature, "seed": d.seed}
    update = {k: v for k, v in given.items()
              if v is not None and k not in body.model_fields_set and k in type(body).model_fields}
    return body.model_copy(update=update) if update else body


async def collect_outputs(gen: Generation, http: Request) -> list[StepOutput]:
    """Every output of `gen` until it finishes; aborted if the client goes away meanwhile."""
    outs: list[StepOutput] = []

    async def drain() -> None:
        async for out in gen.outputs():
            if out.progress is None:
                outs.append(out)

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                break
    finally:
        gen.close()
    return outs


def is_llama_path(request: Request) -> bool:
    """llama-server's dialect (error shapes, stream framing) off /v1/*; OpenAI's on it."""
    return not request.url.path.startswith("/v1/")


def sampling_or_400(build: Any, max_tokens: int,
                    logit_bias: tuple[tuple[int, float], ...] = ()) -> SamplingParams:
    try:
        params = build(max_tokens)
        return dataclasses.replace(params, logit_bias=logit_bias) if logit_bias else params
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_value") from None


_MESSAGES = {"extra_forbidden": "unknown field; this server does not support it",
             "none_required": "not supported by this server (send null or leave it out)"}


def _check_json_type(content_type: str) -> None:
    """415 unless the body is declared application/json (any parameters, e.g. charset).

    NOTE: a browser sends a cross-origin POST of text/plain, form or multipart data without a
    CORS preflight; refusing every other type keeps a web page from driving the server."""
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise ApiError(415, f"the body must be JSON sent as Content-Type: application/json "
                       f"(got {got})", "unsupported_media_type")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the body is larger than {limit} bytes", "request_too_large")
