"""ToolFormat: how one model family writes tool calls (and its thinking), read back piece by piece.

A format says whether the chat template renders tools, calls and results itself (`native`), how
a call is rendered into history when it does not, the llguidance grammar of its call syntax,
and makes a CallParser per sample. A parser turns the sample's text, fed as it streams, into
Pieces in order:

    ("content", -1, text)     answer text
    ("reasoning", -1, text)   thinking-channel text
    ("name", i, name)         call i opens: its function's name
    ("args", i, fragment)     a fragment of call i's arguments (JSON text)

Concatenated, a call's fragments are its arguments as JSON; `is_complete` after `finish` says
whether every call it opened also closed. The formats: muser/server/tool_json.py (templates
without one of their own, Gemma 3's), muser/server/tool_gemma4.py (Gemma 4's native syntax)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple


class Piece(NamedTuple):
    kind: str  # "content" | "reasoning" | "name" | "args"
    index: int  # the call's index in the sample (-1 for content and reasoning)
    text: str


class Function(NamedTuple):
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of an object


class SchemaUnsupported(ValueError):
    """A function's parameters use what a format's grammar cannot hold faithfully (a 400)."""

    def __init__(self, function: str, message: str) -> None:
        super().__init__(message)
        self.function = function


class CallParser(ABC):
    is_complete: bool = True  # after finish: no call was left open (cut off, or malformed)

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The next text of the sample -> the pieces it completes (text may be held back)."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """The sample ended -> the pieces of whatever was held back."""


class ToolFormat(ABC):
    name: str
    native: bool  # the template renders `tools`, assistant `tool_calls` and `tool` turns
    # NOTE: markers that are control tokens (hidden from text): the parser reads these ones
    special_text: frozenset[str] = frozenset()

    @abstractmethod
    def parser(self, calls: bool) -> CallParser:
        """A parser for one sample; calls: tools are on (False: only its thinking is read)."""

    def has_reasoning(self) -> bool:
        """Whether its parser finds thinking text even with tools off."""
        return False

    @abstractmethod
    def grammar(self, functions: list[Function], required: bool, parallel: bool) -> str:
        """Lark text (llguidance) of its output: calls of these functions, each one's
        arguments held to its schema; required: nothing but calls, else text or calls (the
        constraint bites once a call opens). A schema it cannot hold faithfully raises
        SchemaUnsupported."""
