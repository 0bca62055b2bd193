"""Anthropic's Messages API: /v1/messages (a message, or its stream of events) and
/v1/messages/count_tokens, run through the chat route (muser/server/messages_request.py
converts the request; this file converts the reply).

    reply    {"id": "msg_...", "type": "message", "role": "assistant", "model",
             "content": [thinking] [text] [tool_use...], "stop_reason": "end_turn" |
             "max_tokens" | "tool_use", "stop_sequence": null,
             "usage": {"input_tokens" (not from the cache), "cache_read_input_tokens",
                       "cache_creation_input_tokens": 0, "output_tokens"}}
    stream   message_start, then per block content_block_start / _delta (text_delta,
             thinking_delta, input_json_delta) / _stop, message_delta (stop_reason, usage),
             message_stop; a generation that fails ends it with an `error` event

Errors keep muser's body ({"error": {"message", "type", ...}}) with Anthropic's status codes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import Field

from muser.server.context import ServerContext, validate
from muser.server.generation import Generation, GenerationStream
from muser.server.messages_request import to_chat
from muser.server.openai_routes import chat, chat_prompt_ids, chunks_of
from muser.server.protocol import MAX_MESSAGES, ChatMessage, ChatRequest

router = APIRouter()

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesChat(ChatRequest):
    """The converted request: its conversation may be empty, as llama-server allows."""

    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]


async def _chat_body(request: Request) -> MessagesChat:
    ctx: ServerContext = request.app.state.ctx
    return validate(MessagesChat, to_chat(await ctx.read_json(request)))


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    ctx: ServerContext = request.app.state.ctx
    body = await _chat_body(request)
    result = await chat(ctx, body, request, llama=False)
    if isinstance(result, GenerationStream):
        return GenerationStream(result.gen, _events(result.body_iterator, result.gen))
    return _message(result)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """The prompt's tokens (nothing is generated; max_tokens is not needed)."""
    ctx: ServerContext = request.app.state.ctx
    return {"input_tokens": len(await chat_prompt_ids(ctx, await _chat_body(request), False))}


def _usage(num_prompt: int, num_cached: int, num_output: int) -> dict[str, int]:
    return {"input_tokens": num_prompt - num_cached, "cache_read_input_tokens": num_cached,
            "cache_creation_input_tokens": 0, "output_tokens": num_output}


def _message(chat_reply: dict[str, Any]) -> dict[str, Any]:
    choice, usage = chat_reply["choices"][0], chat_reply["usage"]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": ""})
    if msg.get("content") or not msg.get("tool_calls"):
        content.append({"type": "text", "text": msg.get("content") or ""})
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])}
                for c in msg.get("tool_calls") or []]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"id": "msg_" + chat_reply["id"].removeprefix("chatcmpl-"), "type": "message",
            "role": "assistant", "model": chat_reply["model"], "content": content,
            "stop_reason": _STOP[choice["finish_reason"]], "stop_sequence": None,
            "usage": _usage(usage["prompt_tokens"], cached, usage["completion_tokens"])}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of one streamed reply: each delta goes to the open block of its
    kind, else closes that one and opens the next."""

    def __init__(self) -> None:
        self.index, self.kind = -1, ""

    def open(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [_event("content_block_start", {"index": self.index,
                                                        "content_block": block})]

    def close(self) -> list[str]:
        if not self.kind:
            return []
        events = [_event("content_block_delta", {"index": self.index, "delta": {
            "type": "signature_delta", "signature": ""}})] if self.kind == "thinking" else []
        self.kind = ""
        return events + [_event("content_block_stop", {"index": self.index})]

    def delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        events = self.open(kind, block) if self.kind != kind else []
        return events + [_event("content_block_delta", {"index": self.index, "delta": delta})]

    def feed(self, delta: dict[str, Any]) -> list[str]:
        """One chat delta -> its events."""
        events: list[str] = []
        if delta.get("reasoning_content"):
            events += self.delta("thinking", {"type": "thinking", "thinking": ""}, {
                "type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            events += self.delta("text", {"type": "text", "text": ""},
                                 {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            function = call["function"]
            if "id" in call:
                events += self.open("tool_use", {"type": "tool_use", "id": call["id"],
                                                 "name": function["name"], "input": {}})
            if function.get("arguments"):
                events.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": function["arguments"]}}))
        return events


async def _events(chunks: AsyncIterator[str], gen: Generation) -> AsyncIterator[str]:
    """The chat stream's chunks (sample 0's) -> Anthropic's events. message_start waits for
    the first output, which tells the cached prompt tokens."""
    blocks, head, reason = _Blocks(), None, "stop"
    async for chunk in chunks_of(chunks):
        if "error" in chunk:
            yield _event("error", {"error": {"type": chunk["error"]["type"],
                                             "message": chunk["error"]["message"]}})
            return
        if head is None and gen.last is not None:
            head = chunk
            yield _start(chunk, gen)
        for choice in chunk["choices"]:
            for event in blocks.feed(choice["delta"]):
                yield event
            reason = choice["finish_reason"] or reason
    if head is None:
        yield _start(chunk, gen)
    if blocks.index < 0:  # NOTE: a reply with no text still has its (empty) text block
        for event in blocks.open("text", {"type": "text", "text": ""}):
            yield event
    for event in blocks.close():
        yield event
    yield _event("message_delta", {"delta": {"stop_reason": _STOP[reason],
                                             "stop_sequence": None},
                                   "usage": {"output_tokens": gen.num_output}})
    yield _event("message_stop", {})


def _start(chunk: dict[str, Any], gen: Generation) -> str:
    return _event("message_start", {"message": {
        "id": "msg_" + chunk["id"].removeprefix("chatcmpl-"), "type": "message",
        "role": "assistant", "content": [], "model": chunk["model"], "stop_reason": None,
        "stop_sequence": None, "usage": _usage(gen.num_prompt, gen.num_cached, 0)}})
