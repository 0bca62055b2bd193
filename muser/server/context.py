"""ServerContext: what every route needs, plus body parsing and request admission."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from muser.core import SamplingParams
from muser.engine import PromptError
from muser.scheduler import QueueFull
from muser.server.auth import Keys
from muser.server.errors import ApiError
from muser.server.generation import Generation
from muser.server.engine_process import EngineDead, EngineProcess
from muser.server.metrics import Metrics
from muser.tokenizer import Tokenizer

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
    batching: dict[str, Any] = field(default_factory=dict)

    async def read_body(self, request: Request, model: type[BodyT]) -> BodyT:
        """Size-limited, strict JSON -> `model`; any problem is a 4xx ApiError."""
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
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
        try:
            return model.model_validate(obj)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"])
            raise ApiError(400, f"{param}: {err['msg']}", "invalid_value", param) from None

    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name:
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

    def max_tokens(self, requested: int | None, default: int, param: str) -> int:
        if requested is not None and requested > self.max_model_len:
            raise ApiError(400, f"{param} must be <= {self.max_model_len} (the context length)",
                           "invalid_value", param)
        return requested or default

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        try:
            return Generation(self.loop, self.metrics, prompt_ids, sampling)
        except PromptError as exc:
            raise ApiError(400, str(exc), "context_length_exceeded", "prompt") from None
        except EngineDead as exc:
            raise ApiError(503, f"the engine is not running ({exc}); see the server log",
                           "engine_dead") from None
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy ({exc}); retry later",
                           "rate_limit_exceeded", headers={"Retry-After": "1"}) from None


def sampling_or_400(build: Any, max_tokens: int) -> SamplingParams:
    try:
        return build(max_tokens)
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_value") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the body is larger than {limit} bytes", "request_too_large")
