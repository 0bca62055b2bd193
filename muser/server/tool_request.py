"""The tool fields of a chat request, as OpenAI shapes them (strict pydantic).

    tools                [{"type": "function", "function": {"name", "description",
                         "parameters" (a JSON schema of an object), "strict"}}]
    tool_choice          "none" | "auto" | "required" | {"type": "function",
                         "function": {"name"}}
    parallel_tool_calls  true (default) | false: at most one call per reply
    messages             assistant "tool_calls": [{"id", "type": "function", "function":
                         {"name", "arguments" (JSON text)}}]; role "tool" with "tool_call_id"

The legacy `functions` / `function_call` stay refused by name (muser/server/protocol.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDef(Body):
    name: FunctionName
    description: Annotated[str, Field(max_length=4096)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionRef(Body):
    name: FunctionName


class NamedChoice(Body):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedChoice
Tools = Annotated[list[ToolDef], Field(min_length=1, max_length=MAX_TOOLS)]


class CalledFunction(Body):
    name: FunctionName
    arguments: str  # JSON text of an object (the route parses it)


class ToolCall(Body):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: CalledFunction
