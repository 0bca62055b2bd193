"""Tool formats against fixed model outputs (whole and fed a character at a time): the JSON
format's calls, Gemma 4's calls and thinking, malformed and cut-off replies as content; the
JSON format's grammar on the real vocabulary holds a call to its function's schema."""

from __future__ import annotations

import json

import gguf
import pytest

from muser.constraint import GrammarLimits, Vocab, compile_constraint
from muser.server.protocol import ChatRequest
from muser.server.tool_calls import FORMATS, choose_format, conversation, plan
from muser.server.tool_format import Function, Piece
from muser.server.tool_gemma4 import parse_call
from muser.server.tool_replies import StreamReader, message, sample_text
from muser.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "now"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _plan(fmt: str, **fields):
    body = ChatRequest.model_validate({"messages": ASK, "tools": TOOLS, **fields})
    return plan(body, FORMATS[fmt])


def _pieces(fmt: str, text: str, step: int) -> tuple[list[Piece], bool]:
    parser = FORMATS[fmt].parser(True)
    out = [p for i in range(0, len(text), step) for p in parser.feed(text[i:i + step])]
    return out + parser.finish(), parser.is_complete


def _joined(pieces: list[Piece]) -> tuple[str, list[tuple[str, str]]]:
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if p.kind in ("name", "args"):
            calls.setdefault(p.index, []).append(p.text)
    content = "".join(p.text for p in pieces if p.kind == "content")
    return content, [(c[0], "".join(c[1:])) for _, c in sorted(calls.items())]


JSON_CASES = [  # text -> (content, calls) of the whole reply
    ('{"name":"get_weather","parameters":{"city":"Pa\\"ris}","days":2}}',
     ("", [("get_weather", '{"city":"Pa\\"ris}","days":2}')])),
    (('\n {"name": "now", "arguments": {}}\n{"name":"get_weather","parameters":{"city":"[x]",'
     '"days":1}}'), ("", [("now", "{}"), ("get_weather", '{"city":"[x]","days":1}')])),
    ("It is sunny {probably}.", ("It is sunny {probably}.", [])),
    ('{"city": "Paris"}', ('{"city": "Paris"}', [])),
    ("", ("", [])),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("text,expected", JSON_CASES)
def test_json_parser_reads_fixed_outputs(text: str, expected: tuple, step: int) -> None:
    pieces, complete = _pieces("json", text, step)
    assert _joined(pieces) == expected and complete


@pytest.mark.parametrize("text", [
    '{"name":"get_weather","parameters":{"city":"Pa',  # cut off inside the arguments
    '{"name":"get_weather","parameters":{"city":"Paris","days":1}}\n{"name":"no',  # 2nd call
    '{"name":"get_weather","parameters":{"city":"Paris","days":1}',  # no closing brace
])
def test_json_cut_off_calls_are_incomplete_and_come_back_as_content(text: str) -> None:
    assert not _pieces("json", text, 2)[1]
    reply, called = message(_plan("json"), text)
    assert not called and reply == {"role": "assistant", "content": text}


@pytest.mark.parametrize("text", [
    '{"name":"delete_all","parameters":{}}',  # a function not offered
    '{"name":"get_weather","parameters":[1,2]}',  # arguments no object
    '{"name":"get_weather","parameters":{"city":"x","days":1}} and then some text',
])
def test_json_malformed_calls_come_back_as_content(text: str) -> None:
    reply, called = message(_plan("json"), text)
    assert not called and reply["content"] == text and "tool_calls" not in reply


def test_message_has_openai_shape() -> None:
    reply, called = message(_plan("json"), '{"name":"now","parameters":{}}')
    call = reply["tool_calls"][0]
    assert called and reply["content"] is None and call["id"].startswith("call_")
    assert call["type"] == "function" and call["function"] == {"name": "now", "arguments": "{}"}


GEMMA4_CASES = [
    (('<|channel>thought\nNeed the weather.<channel|>Checking.<|tool_call>call:get_weather{'
     'city:<|"|>Paris, FR<|"|>,days:3}<tool_call|><|tool_call>call:now{}<tool_call|>'),
     ("Checking.", [("get_weather", '{"city": "Paris, FR", "days": 3}'), ("now", "{}")]),
     "Need the weather.", True),
    (('<|tool_call>call:get_weather{city:<|"|>a<|"|>,days:1,opts:{deep:[1,<|"|>b<|"|>,true],'
     'x:null}}<tool_call|>'),
     ("", [("get_weather", ('{"city": "a", "days": 1, "opts": {"deep": [1, "b", true], "x": '
           'null}}'))]), "", True),
    ("<|tool_call>call:{x:1}<tool_call|>", ("<|tool_call>call:{x:1}<tool_call|>", []), "", True),
    ("<|tool_call>get_weather{}<tool_call|>", ("<|tool_call>get_weather{}<tool_call|>", []), "",
     True),
    ('Hi <|tool_call>call:now{a:<|"|>x', ('Hi <|tool_call>call:now{a:<|"|>x', []), "", False),
    ("<|channel>thought\nhmm", ("", []), "hmm", True),
]


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("text,expected,reasoning,complete", GEMMA4_CASES)
def test_gemma4_parser_reads_fixed_outputs(text: str, expected: tuple, reasoning: str,
                                           complete: bool, step: int) -> None:
    pieces, is_complete = _pieces("gemma4", text, step)
    assert _joined(pieces) == expected and is_complete == complete
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == reasoning


def test_gemma4_arguments_parse() -> None:
    assert parse_call('call:f{s:<|"|>a, b}<|"|>,n:-2.5,e:[]}') == ("f", {"s": "a, b}", "n": -2.5,
                                                                       "e": []})
    assert parse_call("call:f{a:1") is None and parse_call("call:f{a:1}}") is None
    assert parse_call("call:f{a:1e400}") is None  # Infinity would be no JSON


def test_gemma4_reasoning_without_tools_and_cut_calls_as_content() -> None:
    body = ChatRequest.model_validate({"messages": ASK})
    no_tools = plan(body, FORMATS["gemma4"])
    assert no_tools.parses and not no_tools.is_on
    reply, _ = message(no_tools, "<|channel>thought\nplan<channel|>Answer.")
    assert reply == {"role": "assistant", "content": "Answer.", "reasoning_content": "plan"}
    reply, called = message(_plan("gemma4"), "x<|tool_call>call:now{")
    assert not called and reply["content"] == "x<|tool_call>call:now{"


def test_format_chosen_from_the_template_or_the_flag() -> None:
    assert choose_format("{{ '<|tool_call>call:' }}", None).name == "gemma4"
    assert choose_format("<start_of_turn>", None).name == "json"
    assert choose_format("{{ '<|tool_call>' }}", "json").name == "json"


def test_gemma4_holds_every_mode_to_its_grammar() -> None:
    """required, a named function and auto all constrain (tests/server/test_tool_gemma4.py
    walks the grammar itself); a named function's grammar offers that function only."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    for fields in ({"tool_choice": "required"}, {"tools": strict}, {}):
        grammar = _plan("gemma4", **fields).grammar()
        assert "call:get_weather" in grammar and "call:now" in grammar
    named = _plan("gemma4", tool_choice={"type": "function", "function": {"name": "now"}})
    assert "call:now" in named.grammar() and "call:get_weather" not in named.grammar()


class _Out:
    def __init__(self, text: str, token_id: int | None = None) -> None:
        self.text_delta, self.token_id = text, token_id


def test_stream_deltas_have_the_openai_shape() -> None:
    reader = StreamReader(_plan("json"), Tokenizer.__new__(Tokenizer))
    text = '{"name":"get_weather","parameters":{"city":"Rome","days":2}}\n{"name":"now",' \
           '"parameters":{}}'
    deltas = [d for i in range(0, len(text), 5) for d in reader.feed(_Out(text[i:i + 5]))]
    deltas += reader.finish()
    opened = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [(c["index"], c["function"]) for c in opened] == [
        (0, {"name": "get_weather", "arguments": ""}), (1, {"name": "now", "arguments": ""})]
    args = ["".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas
                    if d["tool_calls"][0]["index"] == i) for i in (0, 1)]
    assert [json.loads(a) for a in args] == [{"city": "Rome", "days": 2}, {}]
    assert reader.made_calls


def test_history_goes_through_a_template_without_tools() -> None:
    body = ChatRequest.model_validate({"messages": ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
        {"role": "tool", "tool_call_id": "c1", "content": "again"}], "tools": TOOLS})
    turns, tools = conversation(body, plan(body, FORMATS["json"]))
    assert tools is None and [t["role"] for t in turns] == ["system", "user", "assistant",
                                                            "user"]
    assert "get_weather" in turns[0]["content"]
    assert turns[2]["content"] == '{"name":"get_weather","parameters":{"city":"Paris","days":1}}'
    assert turns[3]["content"] == ('{"name": "get_weather", "response": {"temp": 20}}\n'
                                   '{"name": "get_weather", "response": "again"}')
    native, offered = conversation(body, plan(body, FORMATS["gemma4"]))
    assert [t["function"]["name"] for t in offered] == ["get_weather", "now"]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}
    assert native[2] == {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "c1",
                         "name": "get_weather"}


@pytest.fixture(scope="module")
def vocab(gguf_reader: gguf.GGUFReader) -> Vocab:
    return Vocab(Tokenizer.from_gguf(gguf_reader))


def _walk(vocab: Vocab, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` token by token and may end after it."""
    matcher = compile_constraint(vocab, grammar, GrammarLimits(), check=True).matcher
    ids = vocab.tokenizer.encode(text, add_bos=False, parse_special=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_json_grammar_holds_calls_to_their_schemas(vocab: Vocab) -> None:
    fns = [Function("get_weather", None, CITY), Function("now", None, {"type": "object"})]
    fmt = FORMATS["json"]
    required, auto = fmt.grammar(fns, True, False), fmt.grammar(fns, False, True)
    good = '{"name":"get_weather","parameters":{"city":"Paris","days":3}}'
    assert _walk(vocab, required, good) and _walk(vocab, auto, good + '\n{"name":"now",'
                                                  '"parameters":{}}')
    for bad in ('{"name":"get_weather","parameters":{"city":"Paris","days":0}}',
                '{"name":"get_weather","parameters":{"city":"Paris"}}',
                '{"name":"delete","parameters":{}}', "Sunny.", good + '\n' + good):
        assert not _walk(vocab, required, bad), bad
    assert _walk(vocab, auto, "Sunny, {probably}.") and _walk(vocab, auto, " " + good)
    assert not _walk(vocab, auto, '{"city":"Paris"}')


def test_marker_tokens_are_read_as_text(vocab: Vocab) -> None:
    """A format's markers that are control tokens reach its parser; other ones stay hidden."""
    tok = vocab.tokenizer
    marker = tok.token_id("<start_of_turn>")
    assert marker is not None and tok.is_special(marker)
    outs = [_Out("a", 1), _Out("", marker), _Out("b", 2)]
    assert sample_text(outs, tok, frozenset({"<start_of_turn>"})) == "a<start_of_turn>b"
    assert sample_text(outs, tok, frozenset({"<|tool_call>"})) == "ab"
