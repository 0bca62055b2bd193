"""A chat sample's text through its ToolPlan's parser -> OpenAI's message and stream deltas.

    message  {"role": "assistant", "content": text | null, ["reasoning_content": text],
             ["tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]]}
    deltas   {"content": text} | {"reasoning_content": text}
             | {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}
             | {"tool_calls": [{"index", "function": {"arguments": fragment}}]}

A sample that made calls and stopped finishes with "tool_calls". Unstreamed, a reply whose
calls do not all parse (cut off by max_tokens, malformed, naming no offered function, arguments
that are no JSON object) is content, its text as it came; streamed, what was sent stays sent."""

from __future__ import annotations

import json
import secrets
from typing import Any

from muser.core import StepOutput
from muser.server.tool_calls import ToolPlan
from muser.server.tool_format import Piece
from muser.tokenizer import Tokenizer


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def sample_text(outputs: list[StepOutput], tokenizer: Tokenizer, special: frozenset[str]
                ) -> str:
    """A sample's text, with the text of the control tokens in `special` (a format's
    markers; other control tokens stay hidden)."""
    return "".join(_text(o, tokenizer, special) for o in outputs)


def _text(out: StepOutput, tokenizer: Tokenizer, special: frozenset[str]) -> str:
    if special and out.token_id is not None and tokenizer.is_special(out.token_id):
        piece = tokenizer.token_to_piece(out.token_id).decode("utf-8", "replace")
        return out.text_delta + piece if piece in special else out.text_delta
    return out.text_delta


def message(plan: ToolPlan, text: str) -> tuple[dict[str, Any], bool]:
    """A whole sample's text -> (its message, whether it made calls)."""
    parser = plan.format.parser(plan.is_on)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p.text for p in pieces if p.kind == "content")
    reasoning = [p.text for p in pieces if p.kind == "reasoning"]
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if p.kind in ("name", "args"):
            calls.setdefault(p.index, []).append(p.text)
    found = [(c[0], "".join(c[1:])) for _, c in sorted(calls.items())]
    if found and not (parser.is_complete and all(_is_call(plan, n, a) for n, a in found)):
        parser = plan.format.parser(False)
        pieces = parser.feed(text) + parser.finish()
        content = "".join(p.text for p in pieces if p.kind == "content")
        found = []
    out: dict[str, Any] = {"role": "assistant", "content": content if content or not found
                           else None}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if found:
        out["tool_calls"] = [{"id": call_id(), "type": "function",
                              "function": {"name": n, "arguments": a}} for n, a in found]
    return out, bool(found)


def _is_call(plan: ToolPlan, name: str, arguments: str) -> bool:
    try:
        return name in plan.names and isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class StreamReader:
    """One streamed sample: its text in, OpenAI deltas out."""

    def __init__(self, plan: ToolPlan, tokenizer: Tokenizer) -> None:
        self.parser = plan.format.parser(plan.is_on)
        self.tokenizer, self.special = tokenizer, plan.format.special_text
        self.made_calls = False

    def feed(self, out: StepOutput) -> list[dict[str, Any]]:
        return self._deltas(self.parser.feed(_text(out, self.tokenizer, self.special)))

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self.parser.finish())

    def _deltas(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        """Pieces -> deltas, a run of one kind (of one call) in one delta."""
        deltas: list[dict[str, Any]] = []
        for p in pieces:
            last = deltas[-1] if deltas else None
            if p.kind in ("content", "reasoning"):
                key = "content" if p.kind == "content" else "reasoning_content"
                if last is not None and key in last:
                    last[key] += p.text
                else:
                    deltas.append({key: p.text})
            elif p.kind == "name":
                self.made_calls = True
                deltas.append({"tool_calls": [{"index": p.index, "id": call_id(),
                                               "type": "function", "function": {
                                                   "name": p.text, "arguments": ""}}]})
            elif (last is not None and "tool_calls" in last and "id" not in
                  last["tool_calls"][0] and last["tool_calls"][0]["index"] == p.index):
                last["tool_calls"][0]["function"]["arguments"] += p.text
            else:
                deltas.append({"tool_calls": [{"index": p.index,
                                               "function": {"arguments": p.text}}]})
        return deltas
