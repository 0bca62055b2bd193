"""Structured output fields -> one llguidance grammar (muser/grammar.py), checked before submit.

    response_format  {"type": "text"} | {"type": "json_object"[, "schema": {...}]}
                     | {"type": "json_schema", "json_schema": {"name", "description", "schema",
                     "strict"}}  (OpenAI; "schema" beside json_object is llama-server's)
    json_schema      a JSON schema (llama-server; {} = any JSON object)
    grammar          GBNF, llama.cpp's grammar format, converted to Lark by llguidance; text
                     that starts with %llguidance is taken as llguidance's Lark as it is

At most one of them per request. A schema or grammar llguidance cannot compile, that matches
nothing (an empty enum, incompatible types, a $ref cycle with no way out), or that costs more
than the --grammar-* limits is a 400 whose param names the field and whose message says why. `strict` is accepted
either way: the output is always held to the schema (stricter than OpenAI's strict: false).
JSON comes out compact: "," and ":" between items, no whitespace outside strings.
The check runs on a small worker pool (muser/server/grammar_check.py), never on the event
loop: llguidance compiles the grammar against the vocabulary and computes its first token
mask there, under the limits the engine applies again (muser/constraint.py).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from muser.constraint import GrammarError
from muser.core import SamplingParams
from muser.server.errors import ApiError

MAX_GRAMMAR_CHARS = 65536
MAX_SCHEMA_VISITS = 100_000  # the base-case search gives up (and lets llguidance judge) past it
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


def compile_grammar(kind: str, spec: Any, limits: Any = None) -> str:
    """A schema or GBNF / %llguidance text -> llguidance grammar text; GrammarError with the
    reason when it does not compile or a schema has no finite instance. limits: an
    llguidance LLParserLimits for the check."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if kind == "schema":
        problem = unsatisfiable(spec)
        if problem:
            raise GrammarError(problem)
        # NOTE: fixed separators ("," and ":"), no free whitespace: a small model can
        # otherwise fill max_tokens with newlines between two valid tokens
        try:
            grammar = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        except Exception as exc:  # noqa: BLE001  (llguidance raises plain Exceptions)
            raise GrammarError(str(exc)) from None
    else:
        try:
            lark = spec if spec.lstrip().startswith("%llguidance") else gbnf_to_lark(spec)
        except Exception as exc:  # noqa: BLE001  (the converter raises plain Exceptions)
            raise GrammarError(f"not valid GBNF: {exc}") from None
        grammar = LLMatcher.grammar_from_lark(lark)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=limits)
    if is_error:
        raise GrammarError(messages[0] if messages else "does not compile")
    return grammar


def unsatisfiable(schema: Any) -> str | None:
    """Why a JSON schema has no finite instance (a $ref cycle with no way out, e.g. {"$ref":
    "#"} or a required property that is the whole schema again), or None.

    A node has a finite instance when one of its alternatives has one whose parts all have
    one; a smallest instance never passes through the same $ref twice on one path, so a $ref
    already on the path counts as having none. Keywords not looked at count as satisfiable
    (llguidance judges the rest)."""
    visits = [0]

    def finite(node: Any, path: frozenset[str]) -> bool:
        visits[0] += 1
        if visits[0] > MAX_SCHEMA_VISITS or not isinstance(node, dict):
            return node is not False
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref in path:
                return False
            target = _resolve(schema, ref)
            if target is not None and not finite(target, path | {ref}):
                return False
        for key in ("anyOf", "oneOf"):
            alts = node.get(key)
            if isinstance(alts, list) and alts and not any(finite(a, path) for a in alts):
                return False
        alls = node.get("allOf")
        if isinstance(alls, list) and not all(finite(a, path) for a in alls):
            return False
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if any(t not in ("object", "array") for t in types):
            return True  # NOTE: a scalar type (or none given) ends here
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        objects = "object" in types and all(finite(props.get(r, True), path) for r in required
                                           if isinstance(r, str))
        items = node.get("items", True)
        min_items = node.get("minItems", 0)
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        arrays = "array" in types and (not isinstance(min_items, int) or min_items <= 0 or (
            all(finite(p, path) for p in prefix[:min_items])
            and (min_items <= len(prefix) or finite(items, path))))
        return objects or arrays

    if finite(schema, frozenset({"#"})):
        return None
    return "it has no finite instance: a $ref cycle with no way out (recursion with no base case)"


def _resolve(root: Any, ref: str) -> Any:
    """A local JSON pointer ("#", "#/$defs/x") inside root, or None."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


async def with_grammar(body: LlamaStructured, sampling: SamplingParams,
                       checker: Any) -> SamplingParams:
    """sampling with the request's grammar, or as it is; a 400 naming the field when the
    schema or grammar does not compile, matches nothing or costs too much. checker: the
    server's GrammarCheck."""
    asked = requested(body)
    if asked is None:
        return sampling
    param, kind, spec = asked
    try:
        grammar = await checker.check(kind, spec)
    except GrammarError as exc:
        what = "the JSON schema" if kind == "schema" else "the grammar"
        raise ApiError(400, f"{param}: {what} does not compile: {exc}", "invalid_value",
                       param) from None
    return dataclasses.replace(sampling, grammar=grammar)
