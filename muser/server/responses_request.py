"""An OpenAI Responses request -> the chat request muser runs (as llama-server converts it).

    instructions                 -> a system message first
    input "text"                 -> one user message
    input [items]:
        {"role", "content": "text" | [{"type": "input_text" | "output_text", "text"}]}
        (optionally "type": "message")  -> a message of that role
        {"type": "function_call", "call_id", "name", "arguments"}
                                 -> an assistant tool call (joined to the assistant turn before)
        {"type": "function_call_output", "call_id", "output"}  -> a tool message
        images and files: refused (a 400; the model takes text only)
    tools [{"type": "function", "name", "description", "parameters", "strict"}]
    tool_choice "auto" | "none" | "required" | {"type": "function", "name"}
    max_output_tokens -> max_tokens; llama-server's timings_per_token and return_progress pass

Nothing is stored: previous_response_id is refused and store may only be false."""

from __future__ import annotations

from typing import Any

from muser.server.errors import bad_field, refuse_unknown

_PASSED = ("model", "temperature", "top_p", "top_k", "seed", "stream", "parallel_tool_calls",
           "user", "timings_per_token", "return_progress")
_KNOWN = frozenset(_PASSED + ("input", "instructions", "max_output_tokens", "tools",
                              "tool_choice", "store"))
_TEXT_PARTS = ("input_text", "output_text")


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The Responses body -> a /v1/chat/completions body; a shape it cannot carry is a 400
    naming the field."""
    refuse_unknown(body, _KNOWN, " (nothing is stored: each request carries its whole "
                   "conversation)")
    if body.get("store"):
        raise bad_field("store", "nothing is stored on this server: send false or leave it out")
    if "input" not in body:
        raise bad_field("input", "field required")
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": body["instructions"]})
    if isinstance(body["input"], str):
        messages.append({"role": "user", "content": body["input"]})
    elif isinstance(body["input"], list):
        for i, item in enumerate(body["input"]):
            _add(messages, item, f"input.{i}")
    else:
        raise bad_field("input", "must be text or a list of input items")
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        choice = body["tool_choice"]
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} if (
            isinstance(choice, dict)) else choice
    return chat


def _add(messages: list[dict[str, Any]], item: Any, param: str) -> None:
    """One input item onto the chat messages."""
    if not isinstance(item, dict):
        raise bad_field(param, "must be an input item (an object)")
    kind = item.get("type", "message")
    if kind == "message":
        messages.append({"role": item.get("role"), "content": _text(item.get("content"),
                                                                    f"{param}.content")})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text(item.get("output"), f"{param}.output")})
    else:
        raise bad_field(f"{param}.type", f"{kind!r} is not an input item this server takes "
                   "(message, function_call, function_call_output)")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(param, "must be text or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            why = "image and file input is not supported: this server's model takes text " \
                  "only" if kind in ("input_image", "input_file") else \
                  "must be an input_text or output_text part with its text"
            raise bad_field(f"{param}.{j}", why)
        texts.append(part["text"])
    return "".join(texts)


def _tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_field(param, "only function tools are supported: {\"type\": \"function\", "
                   "\"name\", \"parameters\"}")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}
