"""Structured output fields -> one llguidance grammar (muser/grammar.py), checked before submit.

    response_format  {"type": "text"} | {"type": "json_object"[, "schema": {...}]}
                     | {"type": "json_schema", "json_schema": {"name", "description", "schema",
                     "strict"}}  (OpenAI; "schema" beside json_object is llama-server's)
    json_schema      a JSON schema (llama-server; {} = any JSON object)
    grammar          GBNF, llama.cpp's grammar format, converted to Lark by llguidance; text
                     that starts with %llguidance is taken as llguidance's Lark as it is

At most one of them per request. A schema or grammar llguidance cannot compile is a 400 whose
param names the field and whose message carries llguidance's reason. `strict` is accepted
either way: the output is always held to the schema (stricter than OpenAI's strict: false).
JSON comes out compact: "," and ":" between items, no whitespace outside strings.
llguidance checks the grammar without a tokenizer here (no torch in the server); the engine
compiles it again against the vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from muser.core import SamplingParams
from muser.server.errors import ApiError

MAX_GRAMMAR_CHARS = 65536
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=False)


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class JsonSchemaSpec(Body):
    name: Annotated[str, Field(max_length=256)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]
Grammar = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]


class LlamaStructured(Body):
    """llama-server's fields (every route)."""

    json_schema: dict[str, Any] | None = None
    grammar: Grammar | None = None


class OpenAIStructured(LlamaStructured):
    """The OpenAI routes add response_format."""

    response_format: ResponseFormat | None = None


def requested(body: LlamaStructured) -> tuple[str, str, Any] | None:
    """-> (param, kind "schema" | "grammar", schema or text) of the one field set, or None."""
    asked: list[tuple[str, str, Any]] = []
    fmt = getattr(body, "response_format", None)
    if isinstance(fmt, JsonObjectFormat):
        asked.append(("response_format", "schema", fmt.schema_ or {"type": "object"}))
    elif isinstance(fmt, JsonSchemaFormat):
        asked.append(("response_format.json_schema.schema", "schema",
                      fmt.json_schema.schema_ or {"type": "object"}))
    if body.json_schema is not None:
        asked.append(("json_schema", "schema", body.json_schema or {"type": "object"}))
    if body.grammar:
        asked.append(("grammar", "grammar", body.grammar))
    if len(asked) > 1:
        names = " and ".join(a[0].split(".")[0] for a in asked)
        raise ApiError(400, f"{names}: give only one of them", "invalid_value", asked[1][0])
    return asked[0] if asked else None


def compile_grammar(kind: str, spec: Any) -> str:
    """A schema or GBNF / %llguidance text -> llguidance grammar text; ValueError with the
    reason when it does not compile."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if kind == "schema":
        # NOTE: fixed separators ("," and ":"), no free whitespace: a small model can
        # otherwise fill max_tokens with newlines between two valid tokens
        grammar = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    else:
        try:
            lark = spec if spec.lstrip().startswith("%llguidance") else gbnf_to_lark(spec)
        except Exception as exc:  # noqa: BLE001  (the converter raises plain Exceptions)
            raise ValueError(f"not valid GBNF: {exc}") from None
        grammar = LLMatcher.grammar_from_lark(lark)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(messages[0] if messages else "does not compile")
    return grammar


async def with_grammar(body: LlamaStructured, sampling: SamplingParams) -> SamplingParams:
    """sampling with the request's grammar, or as it is; a 400 naming the field when the
    schema or grammar does not compile."""
    asked = requested(body)
    if asked is None:
        return sampling
    param, kind, spec = asked
    try:
        grammar = await run_in_threadpool(compile_grammar, kind, spec)
    except ValueError as exc:
        what = "the JSON schema" if kind == "schema" else "the grammar"
        raise ApiError(400, f"{param}: {what} does not compile: {exc}", "invalid_value",
                       param) from None
    return dataclasses.replace(sampling, grammar=grammar)
