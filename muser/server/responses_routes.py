"""OpenAI's Responses API: /v1/responses (and llama-server's /responses), one response or its
stream of events, run through the chat route (muser/server/responses_request.py converts the
request; this file converts the reply). Nothing is stored.

    response  {"id": "resp_...", "object": "response", "created_at", "status": "completed" |
              "incomplete", "model", "output": [reasoning] [message] [function_call...],
              "usage": {"input_tokens", "input_tokens_details": {"cached_tokens"},
              "output_tokens", "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens"}}
    stream    response.created, response.in_progress, per item response.output_item.added,
              its deltas (output_text, reasoning_text, function_call_arguments) and .done
              events, response.output_item.done, then response.completed; each event has a
              sequence_number. With return_progress each prompt report is a
              response.in_progress event carrying prompt_progress; with timings_per_token
              the deltas and response.completed carry llama-server's timings.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from muser.server.context import ServerContext, is_llama_path, validate
from muser.server.generation import Generation, GenerationStream
from muser.server.openai_routes import chat, chat_prompt_ids, chunks_of
from muser.server.protocol import ChatRequest
from muser.server.responses_request import to_chat
from muser.server.results import timings

router = APIRouter()


async def _chat_body(request: Request) -> ChatRequest:
    ctx: ServerContext = request.app.state.ctx
    return validate(ChatRequest, to_chat(await ctx.read_json(request)))


@router.post("/v1/responses")
@router.post("/responses")
async def responses(request: Request) -> Any:
    ctx: ServerContext = request.app.state.ctx
    body = await _chat_body(request)
    result = await chat(ctx, body, request, is_llama_path(request))
    if isinstance(result, GenerationStream):
        events = _Stream(result.gen, body.timings_per_token).events(result.body_iterator)
        return GenerationStream(result.gen, events)
    choice = result["choices"][0]
    return _response(result["id"], result["model"], _items(choice["message"], result["id"]),
                     choice["finish_reason"], _usage(result["usage"]))


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens")
async def input_tokens(request: Request) -> dict[str, int]:
    """How many tokens the input's prompt takes (nothing is generated)."""
    ctx: ServerContext = request.app.state.ctx
    body = await _chat_body(request)
    return {"input_tokens": len(await chat_prompt_ids(ctx, body, is_llama_path(request)))}


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _response(chat_id: str, model: str, output: list[dict[str, Any]], reason: str | None,
              usage: dict[str, Any] | None) -> dict[str, Any]:
    """reason None: still in progress."""
    status = "in_progress" if reason is None else "incomplete" if reason == "length" else (
        "completed")
    return {"id": "resp_" + chat_id.removeprefix("chatcmpl-"), "object": "response",
            "created_at": int(time.time()), "status": status, "model": model, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "error": None, "usage": usage, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": []}


def _items(msg: dict[str, Any], chat_id: str) -> list[dict[str, Any]]:
    """A chat message -> its output items."""
    uid = chat_id.removeprefix("chatcmpl-")
    items = [_reasoning(f"rs_{uid}", msg["reasoning_content"])] if msg.get(
        "reasoning_content") else []
    if msg.get("content") or not msg.get("tool_calls"):
        items.append(_text_item(f"msg_{uid}", msg.get("content") or "", "completed"))
    return items + [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"],
                               "completed") for c in msg.get("tool_calls") or []]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _text_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _reasoning(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"),
            "call_id": call_id, "name": name, "arguments": arguments, "status": status}


class _Stream:
    """The chat stream's chunks (sample 0's) -> the Responses events, one output item open
    at a time."""

    def __init__(self, gen: Generation, per_token: bool) -> None:
        self.gen, self.per_token = gen, per_token
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # done
        self.open: dict[str, Any] | None = None  # the item being streamed, its text so far
        self.chat_id, self.model = "", ""

    @property
    def uid(self) -> str:
        return self.chat_id.removeprefix("chatcmpl-")

    def event(self, kind: str, data: dict[str, Any], chunk: dict[str, Any] | None = None
              ) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        if chunk is not None and "timings" in chunk:
            body["timings"] = chunk["timings"]
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def snapshot(self, reason: str | None) -> dict[str, Any]:
        usage = None if reason is None else _usage({
            "prompt_tokens": self.gen.num_prompt, "completion_tokens": self.gen.num_output,
            "total_tokens": self.gen.num_prompt + self.gen.num_output,
            "prompt_tokens_details": {"cached_tokens": self.gen.num_cached}})
        return _response(self.chat_id, self.model, list(self.items), reason, usage)

    async def events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        reason = "stop"
        async for chunk in chunks_of(chunks):
            if "error" in chunk:
                yield self.event("error", {"code": chunk["error"]["code"],
                                           "message": chunk["error"]["message"], "param": None})
                return
            if not self.chat_id:
                self.chat_id, self.model = chunk["id"], chunk["model"]
                yield self.event("response.created", {"response": self.snapshot(None)})
                yield self.event("response.in_progress", {"response": self.snapshot(None)})
            if "prompt_progress" in chunk:
                yield self.event("response.in_progress", {
                    "response": self.snapshot(None),
                    "prompt_progress": chunk["prompt_progress"]}, chunk)
                continue
            for choice in chunk["choices"]:
                for event in self.feed(choice["delta"], chunk):
                    yield event
                reason = choice["finish_reason"] or reason
        if not self.items and self.open is None:  # NOTE: an empty reply is an empty message
            for event in self.start(_text_item(f"msg_{self.uid}_0", "", "in_progress")):
                yield event
        for event in self.close():
            yield event
        done = {"response": self.snapshot(reason)}
        if self.per_token:
            done["timings"] = timings(self.gen)
        yield self.event("response.completed", done)

    def start(self, item: dict[str, Any]) -> list[str]:
        events = self.close()
        self.open = {"item": item, "text": ""}
        events.append(self.event("response.output_item.added", {
            "output_index": len(self.items), "item": item}))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", {
                "item_id": item["id"], "output_index": len(self.items), "content_index": 0,
                "part": _text_part("")}))
        return events

    def feed(self, delta: dict[str, Any], chunk: dict[str, Any]) -> list[str]:
        events: list[str] = []
        for key, kind, name in (("reasoning_content", "reasoning", "reasoning_text"),
                                ("content", "message", "output_text")):
            if not delta.get(key):
                continue
            if self.open is None or self.open["item"]["type"] != kind:
                uid = f"{'rs' if kind == 'reasoning' else 'msg'}_{self.uid}_{len(self.items)}"
                events += self.start(_reasoning(uid, "") if kind == "reasoning" else
                                     _text_item(uid, "", "in_progress"))
            events.append(self.text_delta(f"response.{name}.delta", delta[key], chunk))
        for call in delta.get("tool_calls") or []:
            function = call["function"]
            if "id" in call:
                events += self.start(_call_item(call["id"], function["name"], "", "in_progress"))
            if function.get("arguments"):
                events.append(self.text_delta("response.function_call_arguments.delta",
                                              function["arguments"], chunk))
        return events

    def text_delta(self, kind: str, text: str, chunk: dict[str, Any]) -> str:
        assert self.open is not None
        self.open["text"] += text
        where = {"item_id": self.open["item"]["id"], "output_index": len(self.items)}
        if kind != "response.function_call_arguments.delta":
            where["content_index"] = 0
        return self.event(kind, {**where, "delta": text}, chunk)

    def close(self) -> list[str]:
        """The open item's .done events; it joins the finished items."""
        if self.open is None:
            return []
        item, text = self.open["item"], self.open["text"]
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "message":
            item = _text_item(item["id"], text, "completed")
            events = [self.event("response.output_text.done",
                                 {**where, "content_index": 0, "text": text}),
                      self.event("response.content_part.done",
                                 {**where, "content_index": 0, "part": _text_part(text)})]
        elif item["type"] == "reasoning":
            item = _reasoning(item["id"], text)
            events = [self.event("response.reasoning_text.done",
                                 {**where, "content_index": 0, "text": text})]
        else:
            item = _call_item(item["call_id"], item["name"], text, "completed")
            events = [self.event("response.function_call_arguments.done",
                                 {**where, "arguments": text})]
        events.append(self.event("response.output_item.done",
                                 {"output_index": len(self.items), "item": item}))
        self.items.append(item)
        self.open = None
        return events
