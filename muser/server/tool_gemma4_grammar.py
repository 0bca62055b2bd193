"""The grammar of Gemma 4's calls (llguidance Lark), each function's `parameters` written in the
call syntax that muser/server/tool_gemma4.py reads back:

    <|tool_call>call:NAME{key:value,...}<tool_call|>

    schema                                       value
    type string (minLength, maxLength)           <|"|>text<|"|>
    type number | integer (minimum, maximum,     JSON's number text (llguidance's %json, or a
      exclusiveMinimum, exclusiveMaximum,        number of at most 16 digits each side and a
      multipleOf)                                2-digit exponent where nothing bounds it),
                                                 which the parser reads with json.loads
    type boolean, null                           true | false, null
    enum, const                                  those values (of the schema's type) written so
    type array (items, minItems, maxItems)       [v,v,...]
    type object (properties, required,           {key:v,...}: the declared properties in their
      additionalProperties)                      order, optional ones may be left out, no others
    a list of types, anyOf, no type              the alternatives
    {} or true                                   any value of the syntax

Any other keyword (pattern, format, oneOf, allOf, not, $ref, prefixItems, ...) raises
SchemaUnsupported (a 400 naming it): a call is never held more loosely than its schema. Control
tokens are referenced by name (llguidance's <|tool_call>): a vocabulary without them fails to
compile. Free text (string values, thinking, text before the calls) never spells a marker's
text, so the parser reads back what the grammar meant. No free whitespace."""

from __future__ import annotations

import json
import math
from typing import Any

from muser.server.structured import JSON_OPTIONS
from muser.server.tool_format import Function, SchemaUnsupported
from muser.server.tool_gemma4_markers import CALL_CLOSE, CALL_OPEN, QUOTE, THINK_CLOSE, THINK_OPEN

MARKERS = (CALL_OPEN, CALL_CLOSE, QUOTE, THINK_OPEN, THINK_CLOSE)
TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
TYPED = {"string": ("minLength", "maxLength"), "array": ("items", "minItems", "maxItems"),
         "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
         "object": ("properties", "required", "additionalProperties")}
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema",
                         "$id", "deprecated", "readOnly", "writeOnly"})
KNOWN = ANNOTATIONS | {"type", "enum", "const", "anyOf"} | {k for ks in TYPED.values() for k in ks}
# NOTE: a number of no range is JSON's number text short enough to stay a finite double once
# the parser reads it (1e400 would come back as Infinity, which is no JSON)
_NUMBER = r"/-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?/"
_NO_MARKER = "~/(?s:.*)(" + "|".join(m.replace("|", "\\|") for m in MARKERS) + ")(?s:.*)/"


class _Refused(ValueError):
    pass


def calls_grammar(functions: list[Function], required: bool, parallel: bool) -> str:
    """Lark text of a reply: an optional thinking block, then the calls (required), or text
    and then optionally the calls (auto: held from <|tool_call> on); parallel: one or more."""
    writer = _Writer()
    names = []
    for i, f in enumerate(functions):
        if "anyOf" in f.parameters:
            raise SchemaUnsupported(f.name, "#: anyOf at the top of parameters is not supported")
        try:
            args = writer.value({**f.parameters, "type": "object"}, "#")
        except _Refused as exc:
            raise SchemaUnsupported(f.name, str(exc)) from None
        names.append(writer.rule(f"{_lit('call:' + f.name)} {args}", f"f{i}"))
    calls = "(call+)" if parallel else "call"
    start = f"think? {calls}" if required else f"think? TEXT? {calls}?"
    return "\n".join([
        "%llguidance {}", f"start: {start}", f"think: {THINK_OPEN} TEXT? {THINK_CLOSE}",
        f"call: {CALL_OPEN} ({' | '.join(names)}) {CALL_CLOSE}",
        f"TEXT: /(?s:.)+/ & {_NO_MARKER}", *writer.rules]) + "\n"


class _Writer:
    """Rules of values, one per distinct schema."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.terminals: set[str] = set()
        self.memo: dict[str, str] = {}
        self.count = 0

    def rule(self, body: str, name: str | None = None) -> str:
        name = name or self._name()
        self.rules.append(f"{name}: {body}")
        return name

    def _name(self) -> str:
        self.count += 1
        return f"v{self.count}"

    def value(self, node: Any, where: str) -> str:
        """A schema -> the name of the rule of its values."""
        node = {} if node is True else node
        if not isinstance(node, dict):
            raise _Refused(f"{where}: a schema must be an object or true (false allows nothing)")
        unknown = sorted(set(node) - KNOWN)
        if unknown:
            raise _Refused(f"{where}: the keyword {unknown[0]!r} is not supported")
        key = json.dumps(node, sort_keys=True)
        if key not in self.memo:  # NOTE: named before its body, which may refer back to it
            self.memo[key] = name = self._name()
            self.rule(self._alternatives(node, where), name)
        return self.memo[key]

    def _alternatives(self, node: dict[str, Any], where: str) -> str:
        if "anyOf" in node:
            beside = sorted(set(node) - ANNOTATIONS - {"anyOf"})
            if beside:
                raise _Refused(f"{where}: {beside[0]!r} beside anyOf is not supported")
            if not isinstance(node["anyOf"], list) or not node["anyOf"]:
                raise _Refused(f"{where}: anyOf must be a non-empty list")
            return " | ".join(self.value(a, f"{where}/anyOf/{i}")
                              for i, a in enumerate(node["anyOf"]))
        types = node.get("type", list(TYPES))
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or any(t not in TYPES for t in types):
            raise _Refused(f"{where}: type must be one of {', '.join(TYPES)} or a list of them")
        if "enum" in node or "const" in node:
            return self._values(node, types, where)
        return " | ".join(self._typed(t, node, where) for t in types)

    def _values(self, node: dict[str, Any], types: list[str], where: str) -> str:
        beside = sorted(set(node) - ANNOTATIONS - {"type", "enum", "const"})
        if beside:
            raise _Refused(f"{where}: {beside[0]!r} beside enum or const is not supported")
        enum = node.get("enum", [node.get("const")])
        if not isinstance(enum, list):
            raise _Refused(f"{where}: enum must be a list")
        kept = [v for v in enum if ("const" not in node or v == node["const"])
                and any(_is(v, t) for t in types)]
        if not kept:
            raise _Refused(f"{where}: no value of enum or const has the schema's type")
        return " | ".join(_literal(v, where) for v in kept)

    def _typed(self, kind: str, node: dict[str, Any], where: str) -> str:
        if kind == "string":
            return self._string(node, where)
        if kind in ("number", "integer"):
            numeric = {k: node[k] for k in TYPED["number"] if k in node}
            for k, v in numeric.items():
                if not _is(v, "number"):
                    raise _Refused(f"{where}: {k} must be a number")
            if kind == "number" and not numeric:
                return self._terminal("NUMBER", _NUMBER)
            schema = {"type": kind, **numeric, "x-guidance": JSON_OPTIONS}
            return self.rule(f"%json {json.dumps(schema)}")
        if kind == "boolean":
            return '"true" | "false"'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self._array(node, where)
        return self._object(node, where)

    def _string(self, node: dict[str, Any], where: str) -> str:
        lo, hi = _bounds(node, "minLength", "maxLength", where)
        if hi == 0:
            return f"{QUOTE} {QUOTE}"
        if lo <= 1 and hi is None:
            name = "TEXT"
        else:
            upto = "" if hi is None else hi
            name = self._terminal(f"STR{max(lo, 1)}_{upto or 'MORE'}",
                                  f"/(?s:.){{{max(lo, 1)},{upto}}}/ & {_NO_MARKER}")
        return f"{QUOTE} {name}{'' if lo else '?'} {QUOTE}"

    def _terminal(self, name: str, body: str) -> str:
        if name not in self.terminals:
            self.terminals.add(name)
            self.rules.append(f"{name}: {body}")
        return name

    def _array(self, node: dict[str, Any], where: str) -> str:
        if isinstance(node.get("items"), list):
            raise _Refused(f"{where}: items as a list (tuples) is not supported")
        lo, hi = _bounds(node, "minItems", "maxItems", where)
        if hi == 0:
            return '"[" "]"'
        item = self.value(node.get("items", True), f"{where}/items")
        upto = "" if hi is None else hi - 1
        more = "" if hi == 1 else f' ("," {item}){{{max(lo - 1, 0)},{upto}}}'
        items = f"{item}{more}"
        return f'"[" {items} "]"' if lo else f'"[" ({items})? "]"'

    def _object(self, node: dict[str, Any], where: str) -> str:
        props, required = node.get("properties", {}), node.get("required", [])
        if not isinstance(props, dict) or not isinstance(required, list):
            raise _Refused(f"{where}: properties must be an object and required a list")
        missing = [r for r in required if r not in props]
        if missing:
            raise _Refused(f"{where}: the required property {missing[0]!r} is not among "
                           "properties")
        after, first = "", ""  # NOTE: after: what may follow a written property; first: the rest
        for name in reversed(list(props)):
            value = self.value(props[name], f"{where}/properties/{name}")
            pair = f"{_lit(_key(name, where) + ':')} {value}"
            if name in required:
                after, first = f'"," {pair} {after}', f"{pair} {after}"
            else:
                first = f"{pair} {after} | {first}" if first else f"({pair} {after})?"
                after = f'("," {pair})? {after}'
            after = self.rule(after.strip())
            first = self.rule(first.strip())
        return f'"{{" {first} "}}"' if first else '"{" "}"'


def _bounds(node: dict[str, Any], low: str, high: str, where: str) -> tuple[int, int | None]:
    lo, hi = node.get(low, 0), node.get(high)
    for k, v in ((low, lo), (high, hi)):
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise _Refused(f"{where}: {k} must be a non-negative integer")
    if hi is not None and hi < lo:
        raise _Refused(f"{where}: {high} is below {low}")
    return lo, hi


def _is(v: Any, kind: str) -> bool:
    """Whether v is an instance of a JSON schema type."""
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    return {"string": isinstance(v, str), "boolean": isinstance(v, bool), "null": v is None,
            "number": number and math.isfinite(v), "array": isinstance(v, list),
            "integer": number and math.isfinite(v) and float(v).is_integer(),
            "object": isinstance(v, dict)}[kind]


def _literal(v: Any, where: str) -> str:
    """One JSON value written in the syntax, as grammar text."""
    if isinstance(v, str):
        return f"{QUOTE} {_lit(_text(v, where))} {QUOTE}" if v else f"{QUOTE} {QUOTE}"
    if isinstance(v, list):
        return " ".join(['"["', ' "," '.join(_literal(x, where) for x in v), '"]"'])
    if isinstance(v, dict):
        pairs = [f"{_lit(_key(k, where) + ':')} {_literal(x, where)}" for k, x in v.items()]
        return " ".join(['"{"', ' "," '.join(pairs), '"}"'])
    return _lit(json.dumps(v))


def _key(name: str, where: str) -> str:
    """A property name as the parser reads it back bare (up to the first ':', stripped)."""
    if ":" in name or name != name.strip().strip('"') or name.startswith("}"):
        raise _Refused(f"{where}: the property name {name!r} cannot be written bare in the "
                       "gemma4 syntax (no ':', no leading '}', no surrounding blanks or '\"')")
    return _text(name, where)


def _text(text: str, where: str) -> str:
    marker = next((m for m in MARKERS if m in text), None)
    if marker is not None:
        raise _Refused(f"{where}: {text!r} holds the marker {marker}, which the gemma4 syntax "
                       "cannot carry as text")
    return text


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
