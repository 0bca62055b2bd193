"""An Anthropic Messages request -> the chat request muser runs (as llama-server converts it).

    system            "text" | [{"type": "text", "text"}]       -> a system message first
    messages[].content "text" | blocks:
        text          {"type": "text", "text"}                   -> a text part
        thinking      {"type": "thinking", "thinking"}           -> reasoning_content
        tool_use      {"type": "tool_use", "id", "name", "input"} -> tool_calls
        tool_result   {"type": "tool_result", "tool_use_id", "content", "is_error"}
                                                                 -> a tool message after it
        image         refused: a 400 (the model takes text only)
    tools             [{"name", "description", "input_schema"}]  -> function tools
    tool_choice       {"type": "auto" | "any" | "tool" | "none"}  -> auto | required | named | none
    stop_sequences -> stop; thinking {"type": "enabled" | "disabled"} -> enable_thinking
    (budget_tokens is not enforced: max_tokens bounds the reply); metadata.user_id -> user

An empty `messages` is taken, as llama-server takes it: the template's bare generation prompt.
"""

from __future__ import annotations

import json
from typing import Any

from muser.server.errors import ApiError, bad_field, refuse_unknown

_PASSED = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream")
_KNOWN = frozenset(_PASSED + ("system", "messages", "tools", "tool_choice", "stop_sequences",
                              "thinking", "metadata"))
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The Messages body -> a /v1/chat/completions body; a shape it cannot carry is a 400
    naming the field."""
    refuse_unknown(body, _KNOWN)
    if "messages" not in body:
        raise bad_field("messages", "field required")
    if not isinstance(body["messages"], list):
        raise bad_field("messages", "must be a list of messages")
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    chat["messages"] = _system(body.get("system")) + [
        m for i, msg in enumerate(body["messages"]) for m in _message(msg, f"messages.{i}")]
    if body.get("tools") is not None:
        chat["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(_list(body, "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("thinking") is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": _thinking(body["thinking"])}
    user = (body.get("metadata") or {}).get("user_id")
    if user is not None:
        chat["user"] = user
    return chat


def _list(body: dict[str, Any], key: str) -> list[Any]:
    if not isinstance(body[key], list):
        raise bad_field(key, "must be a list")
    return body[key]


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise bad_field("system", "must be text or a list of text blocks")
    return [{"role": "system", "content": "".join(
        _text(b, f"system.{i}") for i, b in enumerate(system))}]


def _text(block: Any, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
            block.get("text"), str):
        raise bad_field(param, "must be a text block: {\"type\": \"text\", \"text\": ...}")
    return block["text"]


def _message(msg: Any, param: str) -> list[dict[str, Any]]:
    """One Anthropic message -> its chat messages (a user turn's tool results follow it as
    tool messages)."""
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise bad_field(f"{param}.role", "must be 'user' or 'assistant'")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": msg["role"], "content": content}]
    if not isinstance(content, list):
        raise bad_field(f"{param}.content", "must be text or a list of content blocks")
    parts, calls, results, thinking = [], [], [], []
    for j, block in enumerate(content):
        where = f"{param}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, where)})
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _result(block.get("content"), where)})
        elif kind == "image":
            raise _image(where)
        else:
            raise bad_field(where, f"unknown content block type {kind!r}")
    out: list[dict[str, Any]] = []
    if parts or calls or thinking:
        turn: dict[str, Any] = {"role": msg["role"], "content": parts or ""}
        if calls:
            turn["tool_calls"] = calls
        if thinking:
            turn["reasoning_content"] = "".join(thinking)
        out.append(turn)
    return out + results


def _result(content: Any, param: str) -> str:
    """A tool_result's content -> the tool message's text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(f"{param}.content", "must be text or a list of content blocks")
    for k, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "image":
            raise _image(f"{param}.content.{k}")
    return "".join(_text(b, f"{param}.content.{k}") for k, b in enumerate(content))


def _image(param: str) -> ApiError:
    return bad_field(param, "image input is not supported: this server's model takes text only")


def _tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or "name" not in tool:
        raise bad_field(param, "a tool needs a name (and an input_schema)")
    function = {"name": tool["name"], "parameters": tool.get("input_schema", {})}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind not in _CHOICES:
        raise bad_field("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    return _CHOICES[kind]


def _thinking(thinking: Any) -> bool:
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled"):
        raise bad_field("thinking.type", "must be 'enabled' or 'disabled'")
    return kind == "enabled"
