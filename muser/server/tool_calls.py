"""A chat request's tools -> a ToolPlan: which format, which functions, which mode; the
conversation as the template takes it; the grammar that holds the calls.

    tool_choice   what the reply may be                      constraint (llguidance)
    none          text (tools not offered: as with none)     none
    auto          text, or calls                             once a call opens
    required      one or more calls                          the whole reply
    named         one or more calls of that function         the whole reply

`strict` changes nothing: the arguments are always held to their schema (a schema a format's
grammar cannot hold faithfully is a 400 naming the construct).

The format comes from the template (Gemma 4's `<|tool_call>` in it: gemma4; otherwise json),
or from `muser serve --tool-call-parser`. Every check that fails is a 400 naming its field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from muser.server.errors import ApiError
from muser.server.protocol import ChatMessage, ChatRequest
from muser.server.structured import requested, unsatisfiable
from muser.server.tool_format import Function, SchemaUnsupported, ToolFormat
from muser.server.tool_gemma4 import Gemma4Format
from muser.server.tool_gemma4_markers import CALL_OPEN
from muser.server.tool_json import JsonFormat, call_text, describe, result_text

FORMATS: dict[str, ToolFormat] = {"json": JsonFormat(), "gemma4": Gemma4Format()}


def choose_format(template_source: str, flag: str | None) -> ToolFormat:
    """The flag's format, else the template's (Gemma 4's native one, else json)."""
    if flag is not None:
        return FORMATS[flag]
    return FORMATS["gemma4" if CALL_OPEN in template_source else "json"]


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", "invalid_value", param)


@dataclass(frozen=True)
class ToolPlan:
    format: ToolFormat
    functions: tuple[Function, ...]  # offered (empty: tools off)
    choice: str  # "none" | "auto" | "required" | "named"
    parallel: bool

    @property
    def is_on(self) -> bool:
        return bool(self.functions)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    @property
    def parses(self) -> bool:
        """Whether replies go through the format's parser (tools on, or a thinking channel)."""
        return self.is_on or self.format.has_reasoning()

    def grammar(self) -> str | None:
        """The calls' grammar, or None (tools off)."""
        if not self.is_on:
            return None
        return self.format.grammar(list(self.functions), self.choice != "auto", self.parallel)


def plan(body: ChatRequest, fmt: ToolFormat) -> ToolPlan:
    """The request's tool fields checked -> its plan."""
    choice = body.tool_choice if body.tool_choice is not None else (
        "auto" if body.tools else "none")
    named = None if isinstance(choice, str) else choice.function.name
    if body.tools is None:
        if choice != "none":
            raise _bad("give tools with it (there is no function to call)", "tool_choice")
        return ToolPlan(fmt, (), "none", body.parallel_tool_calls)
    functions = [_function(t.function, i) for i, t in enumerate(body.tools)]
    names = [f.name for f in functions]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise _bad(f"the function name {dup!r} is declared twice", "tools")
    if named is not None and named not in names:
        raise _bad(f"the function {named!r} is not among tools", "tool_choice")
    if choice == "none":
        return ToolPlan(fmt, (), "none", body.parallel_tool_calls)
    if requested(body) is not None:
        raise _bad("response_format, json_schema and grammar cannot be combined with tools "
                   "(tool_choice none allows them)", "tools")
    kept = tuple(f for f in functions if named is None or f.name == named)
    tool_plan = ToolPlan(fmt, kept, "named" if named else choice, body.parallel_tool_calls)
    try:
        tool_plan.grammar()
    except SchemaUnsupported as exc:
        where = f"tools[{names.index(exc.function)}].function.parameters"
        raise _bad(f"{exc} (the {fmt.name} tool format's grammar cannot hold it faithfully)",
                   where) from None
    return tool_plan


def _function(f: Any, i: int) -> Function:
    params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
    where = f"tools[{i}].function.parameters"
    if params.get("type", "object") != "object":
        raise _bad("a function's parameters must be a schema of an object (type: object)",
                   where)
    problem = unsatisfiable(params)
    if problem:
        raise _bad(f"the JSON schema {problem}", where)
    return Function(f.name, f.description, params)


def conversation(body: ChatRequest, tool_plan: ToolPlan
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """-> (the messages, the tools) as the chat template takes them."""
    calls = _calls_by_id(body.messages)
    if tool_plan.format.native:
        turns = [_native_turn(m, calls) for m in body.messages]
        tools = [{"type": "function", "function": {
            "name": f.name, **({"description": f.description} if f.description else {}),
            "parameters": f.parameters}} for f in tool_plan.functions] or None
        return turns, tools
    turns: list[dict[str, Any]] = []
    for m in body.messages:
        turn = _text_turn(m, calls)
        if m.role == "tool" and turns and turns[-1].get("from_tool"):
            turns[-1]["content"] += "\n" + turn["content"]
        else:
            turns.append(turn)
    for turn in turns:
        turn.pop("from_tool", None)
    if tool_plan.is_on:
        offer = describe(list(tool_plan.functions), tool_plan.parallel)
        if turns and turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": offer + "\n\n" + turns[0]["content"]}
        else:
            turns.insert(0, {"role": "system", "content": offer})
    return turns, None


def _calls_by_id(messages: list[ChatMessage]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every assistant call: id -> (name, arguments parsed); tool messages checked against
    the calls before them."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or []):
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise _bad("arguments must be the JSON text of an object",
                           f"messages[{i}].tool_calls[{j}].function.arguments")
            found[call.id] = (call.function.name, args)
        if m.role == "tool" and m.tool_call_id not in found:
            raise _bad(f"tool_call_id {m.tool_call_id!r} answers no earlier assistant call",
                       f"messages[{i}].tool_call_id")
    return found


def _native_turn(m: ChatMessage, calls: dict[str, tuple[str, dict[str, Any]]]
                 ) -> dict[str, Any]:
    turn: dict[str, Any] = m.turn()
    if m.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": calls[c.id][1]}} for c in m.tool_calls]
    if m.role == "tool":
        turn |= {"tool_call_id": m.tool_call_id, "name": calls[m.tool_call_id][0]}
    return turn


def _text_turn(m: ChatMessage, calls: dict[str, tuple[str, dict[str, Any]]]
               ) -> dict[str, Any]:
    """A message for a template without tools: calls as the format's lines, a result as a
    user turn (marked from_tool, so results in a row share one turn)."""
    if m.role == "tool":
        name = calls[m.tool_call_id][0]
        return {"role": "user", "content": result_text(name, m.text()), "from_tool": True}
    turn = m.turn()
    if m.tool_calls:
        lines = [call_text(*calls[c.id]) for c in m.tool_calls]
        turn["content"] = "\n".join(([turn["content"]] if turn["content"] else []) + lines)
    return turn
