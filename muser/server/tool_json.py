"""The generic JSON tool format: for chat templates without one of their own (Gemma 3's).

Gemma 3's documented convention, as muser writes it: the functions are described in the system
turn, and the model calls by answering with JSON objects and nothing else, one per line:

    {"name":"get_weather","parameters":{"city":"Paris"}}

A reply whose first non-blank character is "{" is a call; any other reply is content. History
goes back through the template as text: an assistant's calls as those lines, a `tool` message
as a user turn `{"name":...,"response":...}` (the template has no tool role). The grammar is
compact JSON (no free whitespace), each function's parameters through llguidance's %json."""

from __future__ import annotations

import json
import re
from typing import Any

from muser.server.structured import JSON_OPTIONS
from muser.server.tool_format import CallParser, Function, Piece, ToolFormat

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')
_MAX_HEAD = 512  # a head longer than this is no call: the text is content

INSTRUCTIONS = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST "
    "put it in the format of\n"
    '{"name": function name, "parameters": dictionary of argument name and its value}\n\n'
    "You SHOULD NOT include any other text in the response if you call a function\n")
SEVERAL = "To call several functions, write one such object per line.\n"


def describe(functions: list[Function], parallel: bool) -> str:
    """The system text that offers `functions`."""
    listed = [{"name": f.name, **({"description": f.description} if f.description else {}),
               "parameters": f.parameters} for f in functions]
    return INSTRUCTIONS + (SEVERAL if parallel else "") + json.dumps(listed, indent=2)


def call_text(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "parameters": arguments}, separators=(",", ":"),
                      ensure_ascii=False)


def result_text(name: str, content: str) -> str:
    try:
        response = json.loads(content)
    except ValueError:
        response = content
    return json.dumps({"name": name, "response": response}, ensure_ascii=False)


class JsonCallParser(CallParser):
    """States: start (before the first non-blank character) -> text | head -> args -> close ->
    tail -> head (the next call) | text (what follows the calls)."""

    def __init__(self, calls: bool = True) -> None:
        """calls: False reads every reply as content."""
        self.state, self.buf, self.index = "start" if calls else "text", "", -1
        self.depth, self.in_string, self.escaped = 0, False, False
        self.is_complete = True

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.buf and self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.state in ("start", "head") and self.buf.strip():
            out.append(Piece("content", -1, self.buf))  # NOTE: no call after all
        # NOTE: text after calls makes the reply no call: calls come alone in this format
        self.is_complete = self.state in ("start", "tail") or (
            self.state in ("head", "text") and self.index < 0)
        self.buf = ""
        return out

    def _step(self, out: list[Piece]) -> bool:
        """Consume what the state can -> whether to go on."""
        if self.state == "text":
            out.append(Piece("content", -1, self.buf))
            self.buf = ""
            return False
        if self.state == "start":
            stripped = self.buf.lstrip()
            if not stripped:
                return False
            self.state = "head" if stripped[0] == "{" else "text"
            if self.state == "head":
                self.buf = stripped
            return True
        if self.state == "head":
            return self._head(out)
        if self.state == "args":
            return self._args(out)
        return self._tail(out)

    def _head(self, out: list[Piece]) -> bool:
        m = _HEAD.match(self.buf)
        if m is None:
            if len(self.buf) > _MAX_HEAD:
                self.state = "text"
                return True
            return False
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            self.state = "text"
            return True
        self.index += 1
        out.append(Piece("name", self.index, name))
        self.buf, self.state = self.buf[m.end():], "args"
        self.depth, self.in_string, self.escaped = 0, False, False
        return True

    def _args(self, out: list[Piece]) -> bool:
        """The arguments value, scanned to its closing bracket."""
        if self.depth == 0:
            self.buf = self.buf.lstrip()  # NOTE: blanks before the value are no arguments
        for i, ch in enumerate(self.buf):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    out.append(Piece("args", self.index, self.buf[:i + 1]))
                    self.buf, self.state = self.buf[i + 1:], "close"
                    return True
        if self.buf:
            out.append(Piece("args", self.index, self.buf))
        self.buf = ""
        return False

    def _tail(self, out: list[Piece]) -> bool:
        """After the arguments ("close"): the call's "}"; after the call ("tail"): the next
        call or the end. Anything else is content."""
        stripped = self.buf.lstrip()
        if not stripped:
            return False
        if self.state == "close" and stripped[0] == "}":
            self.buf, self.state = stripped[1:], "tail"
        elif self.state == "tail" and stripped[0] == "{":
            self.buf, self.state = stripped, "head"
        else:
            self.state = "text"
        return True


class JsonFormat(ToolFormat):
    name = "json"
    native = False

    def parser(self, calls: bool) -> CallParser:
        return JsonCallParser(calls)

    def grammar(self, functions: list[Function], required: bool, parallel: bool) -> str:
        rules = []
        for i, f in enumerate(functions):
            head = json.dumps('{"name":' + json.dumps(f.name) + ',"parameters":')
            schema = {**f.parameters, "x-guidance": JSON_OPTIONS}
            rules += [f'f{i}: {head} a{i} "}}"', f"a{i}: %json {json.dumps(schema)}"]
        call = "call: " + " | ".join(f"f{i}" for i in range(len(functions)))
        calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
        # NOTE: auto: a reply whose first non-blank character is not "{" is text (held to
        # nothing); one that opens with "{" is held to the calls from there on
        start = "start: calls" if required else "start: TEXT | LEAD calls\n" + (
            "TEXT: /[ \\t\\n]*([^{ \\t\\n](.|\\n)*)?/\nLEAD: /[ \\t\\n]*/")
        return "\n".join(["%llguidance {}", start, calls, call, *rules]) + "\n"
