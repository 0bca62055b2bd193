"""Gemma 4's native tool and thinking syntax, read from its output (its template writes the
declarations, calls and results itself).

    <|channel>thought\\n ... <channel|>                 thinking (reasoning_content)
    <|tool_call>call:NAME{key:value,...}<tool_call|>   a call; strings are <|"|>...<|"|>,
                                                       other values bare (numbers, true, false,
                                                       null), objects {..} and lists [..] nest

The markers are control tokens: the route passes their text to the parser (special_text).
A call is read whole (its name and its arguments, as JSON, come together); one that does not
parse, or is left open, comes back as content. The calls' grammar, each function's schema
written in this syntax, is muser/server/tool_gemma4_grammar.py."""

from __future__ import annotations

import json
import math
from typing import Any

from muser.server.tool_format import CallParser, Function, Piece, ToolFormat
from muser.server.tool_gemma4_grammar import calls_grammar
from muser.server.tool_gemma4_markers import CALL_CLOSE, CALL_OPEN, QUOTE, THINK_CLOSE, THINK_OPEN

LABEL = "thought\n"


class Gemma4Parser(CallParser):
    def __init__(self, calls: bool) -> None:
        self.calls, self.buf, self.index, self.mode = calls, "", -1, "content"
        self.is_complete = True

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        self.is_complete = self.mode != "call"
        kind = "reasoning" if self.mode in ("label", "thinking") else "content"
        text = CALL_OPEN + self.buf if self.mode == "call" else self.buf
        out = [Piece(kind, -1, text)] if text else []
        self.buf, self.mode = "", "content"
        return out

    def _step(self, out: list[Piece]) -> bool:
        if self.mode == "call":
            end = self.buf.find(CALL_CLOSE)
            if end < 0:
                return False
            raw = CALL_OPEN + self.buf[:end + len(CALL_CLOSE)]
            self.buf, self.mode = self.buf[end + len(CALL_CLOSE):], "content"
            call = parse_call(raw[len(CALL_OPEN):-len(CALL_CLOSE)])
            if call is None:
                out.append(Piece("content", -1, raw))
            else:
                self.index += 1
                out += [Piece("name", self.index, call[0]),
                        Piece("args", self.index, json.dumps(call[1], ensure_ascii=False))]
            return True
        if self.mode == "label":  # NOTE: the channel's name, "thought\n", is no thinking text
            if len(self.buf) < len(LABEL) and LABEL.startswith(self.buf):
                return False
            self.buf, self.mode = self.buf.removeprefix(LABEL), "thinking"
            return True
        if self.mode == "thinking":
            return self._until(out, "reasoning", {THINK_CLOSE: "content"})
        opens = {THINK_OPEN: "label", **({CALL_OPEN: "call"} if self.calls else {})}
        return self._until(out, "content", opens)

    def _until(self, out: list[Piece], kind: str, markers: dict[str, str]) -> bool:
        """Emit text as `kind` up to the first of `markers` (then switch to its mode), holding
        back a tail that may be a marker's start."""
        found = [(self.buf.find(m), m) for m in markers if m in self.buf]
        if found:
            at, marker = min(found)
            if at:
                out.append(Piece(kind, -1, self.buf[:at]))
            self.buf, self.mode = self.buf[at + len(marker):], markers[marker]
            return True
        keep = max((k for m in markers for k in range(1, len(m)) if self.buf.endswith(m[:k])),
                   default=0)
        if len(self.buf) > keep:
            out.append(Piece(kind, -1, self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
        return False


def parse_call(inner: str) -> tuple[str, dict[str, Any]] | None:
    """'call:NAME{...}' -> (NAME, arguments), or None when it does not parse."""
    if not inner.startswith("call:") or "{" not in inner:
        return None
    name, _, rest = inner[5:].partition("{")
    name = name.strip()
    if not name:
        return None
    try:
        args, end = _value("{" + rest, 0)
    except (ValueError, IndexError):
        return None
    return (name, args) if isinstance(args, dict) and not ("{" + rest)[end:].strip() else None


def _value(s: str, i: int) -> tuple[Any, int]:
    """One value of the syntax at s[i] -> (value, index after it)."""
    i = _skip(s, i)
    if s.startswith(QUOTE, i):
        end = s.index(QUOTE, i + len(QUOTE))
        return s[i + len(QUOTE):end], end + len(QUOTE)
    if s[i] in "{[":
        close, items, i = "}" if s[i] == "{" else "]", [], _skip(s, i + 1)
        while s[i] != close:
            if close == "}":
                colon = s.index(":", i)
                key = s[i:colon].strip().strip('"')
                value, i = _value(s, colon + 1)
                items.append((key, value))
            else:
                value, i = _value(s, i)
                items.append(value)
            i = _skip(s, i)
            if s[i] == ",":
                i = _skip(s, i + 1)
            elif s[i] != close:
                raise ValueError(f"expected , or {close}")
        return (dict(items) if close == "}" else items), i + 1
    end = i
    while end < len(s) and s[end] not in ",}]":
        end += 1
    return _scalar(s[i:end].strip()), end


def _scalar(text: str) -> Any:
    if not text:
        raise ValueError("an empty value")
    if text in ("true", "false", "null"):
        return json.loads(text)
    try:
        value = json.loads(text) if text[0] in "-0123456789" else text
    except ValueError:
        return text
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a number past a double's range (no JSON once read)")
    return value


def _skip(s: str, i: int) -> int:
    while s[i] in " \t\n\r":
        i += 1
    return i


class Gemma4Format(ToolFormat):
    name = "gemma4"
    native = True
    special_text = frozenset({CALL_OPEN, CALL_CLOSE, THINK_OPEN, THINK_CLOSE, QUOTE})

    def parser(self, calls: bool) -> CallParser:
        return Gemma4Parser(calls)

    def has_reasoning(self) -> bool:
        return True

    def grammar(self, functions: list[Function], required: bool, parallel: bool) -> str:
        return calls_grammar(functions, required, parallel)
