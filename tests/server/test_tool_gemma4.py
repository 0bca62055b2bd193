"""The gemma4 tool format's grammar (muser/server/tool_gemma4_grammar.py) on the embedded 270M's
vocabulary with Gemma 4's markers as control tokens (tests/server/gemma4_markers.py; no Gemma 4
tokenizer ships offline): fixed calls taken and refused token by token, schemas it cannot hold
refused by name, seeded random walks through the grammar read back by the parser as calls that
validate with jsonschema; and a real server on that vocabulary through the official openai
client (required, named with n = 3, auto with strict, streamed, a two-turn loop)."""

from __future__ import annotations

import json

import gguf
import jsonschema
import numpy as np
import openai
import pytest

from muser.constraint import GrammarLimits, Vocab, compile_constraint
from muser.server.errors import ApiError
from muser.server.protocol import ChatRequest
from muser.server.tool_calls import FORMATS, plan
from muser.server.tool_format import Function
from muser.server.tool_replies import message
from tests.server.conftest import API_KEY, Server, start_server, stop_server
from tests.server.gemma4_markers import MARKERS, TEMPLATE, marked_tokenizer, write_marked_gguf

Q = '<|"|>'
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    "at": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90,
                                                    "maximum": 90}, "lon": {"type": "number"}},
           "required": ["lat", "lon"], "additionalProperties": False},
    "exact": {"type": ["boolean", "null"]}},
    "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"const": "UTC"}}, "required": ["zone"]}
LOOSE = {"type": "object", "properties": {
    "any": {}, "either": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    "grid": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"},
                                        "maxItems": 2}, "minItems": 1, "maxItems": 2}},
    "required": ["grid"]}
SCHEMAS = {"get_weather": WEATHER, "now": CLOCK, "loose": LOOSE}
FUNCTIONS = [Function(name, None, schema) for name, schema in SCHEMAS.items()]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in
         SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]


def _call(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{{{args}}}<tool_call|>"


PARIS = _call("get_weather", f"city:{Q}Paris{Q},days:3")
FULL = _call("get_weather", f"city:{Q}Paris, FR{Q},days:7,unit:{Q}F{Q},tags:[{Q}a b{Q},{Q}{Q}],"
             "at:{lat:-48.5,lon:1e2},exact:null")
NOW = _call("now", f"zone:{Q}UTC{Q}")
LOOSE_CALL = _call("loose", f"any:[1,{Q}x{Q},{{}},[null]],either:{Q}abc{Q},grid:[[true],[]]")


@pytest.fixture(scope="module")
def vocab(gguf_reader: gguf.GGUFReader) -> Vocab:
    return Vocab(marked_tokenizer(gguf_reader))


def _plan(**fields):
    body = ChatRequest.model_validate({"messages": ASK, "tools": TOOLS, **fields})
    return plan(body, FORMATS["gemma4"])


def _grammar(required: bool, parallel: bool) -> str:
    return FORMATS["gemma4"].grammar(FUNCTIONS, required, parallel)


def _takes(vocab: Vocab, grammar: str, ids: list[int]) -> bool:
    """Whether the grammar takes the tokens one by one and may end after them."""
    matcher = compile_constraint(vocab, grammar, GrammarLimits(), check=True).matcher
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def _ids(vocab: Vocab, text: str) -> list[int]:
    """The text's tokens, the markers as their control tokens."""
    return vocab.tokenizer.encode(text, add_bos=False)


def _valid_calls(text: str, **fields) -> list[tuple[str, dict]]:
    """The parser's calls of a reply, each of an offered function, its arguments valid."""
    reply, called = message(_plan(**fields), text)
    assert called, text
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in reply["tool_calls"]]
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])
    return calls


@pytest.mark.parametrize("text", [PARIS, FULL, NOW, LOOSE_CALL,
                                  "<|channel>thought\nThe weather.<channel|>" + PARIS])
def test_required_grammar_takes_calls_the_parser_reads(vocab: Vocab, text: str) -> None:
    assert _takes(vocab, _grammar(True, False), _ids(vocab, text))
    assert len(_valid_calls(text, tool_choice="required")) == 1


def test_full_call_reads_back_as_written() -> None:
    assert _valid_calls(FULL) == [("get_weather", {
        "city": "Paris, FR", "days": 7, "unit": "F", "tags": ["a b", ""],
        "at": {"lat": -48.5, "lon": 100.0}, "exact": None})]


@pytest.mark.parametrize("args", [
    f"days:3,city:{Q}Paris{Q}",  # out of declared order
    f"city:{Q}Paris{Q}",  # days missing
    f"city:{Q}Paris{Q},days:0", f"city:{Q}Paris{Q},days:8", f"city:{Q}Paris{Q},days:2.5",
    f"city:{Q}{Q},days:3", f"city:{Q}Paris, France{Q},days:3",  # 0 and 13 characters
    f"city:{Q}Paris{Q},days:3,unit:{Q}K{Q}", f"city:{Q}Paris{Q},days:3,unit:C",
    f"city:{Q}Paris{Q},days:3,tags:[{Q}a{Q},{Q}b{Q},{Q}c{Q}]",
    f"city:{Q}Paris{Q},days:3,at:{{lat:91,lon:0}}", f"city:{Q}Paris{Q},days:3,at:{{lat:1}}",
    f"city:{Q}Paris{Q},days:3,wind:1",  # no such property
    f"city: {Q}Paris{Q},days:3",  # no free whitespace
    'city:"Paris",days:3',  # strings are between the markers
])
def test_required_grammar_refuses_what_breaks_the_schema(vocab: Vocab, args: str) -> None:
    assert not _takes(vocab, _grammar(True, True), _ids(vocab, _call("get_weather", args)))


@pytest.mark.parametrize("text", [
    _call("delete_all", ""), PARIS + NOW, "Sure. " + PARIS, PARIS + " Done.", "Sunny.",
    _call("now", f"zone:{Q}CET{Q}"), _call("loose", "grid:[]"),
])
def test_required_single_call_refuses_the_rest(vocab: Vocab, text: str) -> None:
    assert not _takes(vocab, _grammar(True, False), _ids(vocab, text))


def test_parallel_calls_and_auto(vocab: Vocab) -> None:
    assert _takes(vocab, _grammar(True, True), _ids(vocab, PARIS + NOW + PARIS))
    assert len(_valid_calls(PARIS + NOW + PARIS)) == 3
    auto = _grammar(False, True)
    for text in ("Sunny, {probably}: 20 C.", "Checking. " + PARIS + NOW, PARIS, "",
                 "<|channel>thought\nhm<channel|>It is sunny."):
        assert _takes(vocab, auto, _ids(vocab, text)), text
    for text in ("Checking. " + _call("get_weather", "days:3"), PARIS + " Done.",
                 "It is <|channel>sunny<channel|>"):
        assert not _takes(vocab, auto, _ids(vocab, text)), text


def test_free_text_never_spells_a_marker(vocab: Vocab) -> None:
    """A marker's text written with plain tokens would mislead the parser: never allowed."""
    tok, grammar = vocab.tokenizer, _grammar(False, False)
    for marker in MARKERS:
        plain = tok.encode(f"a{marker}b", add_bos=False, parse_special=False)
        assert not any(tok.is_special(t) for t in plain)
        assert not _takes(vocab, grammar, plain), marker
        inside = (_ids(vocab, f"<|tool_call>call:get_weather{{city:{Q}") + plain
                  + _ids(vocab, f"{Q},days:1}}<tool_call|>"))
        assert not _takes(vocab, grammar, inside), marker


@pytest.mark.parametrize("schema,words", [
    ({"type": "string", "pattern": "^a"}, "'pattern'"),
    ({"type": "string", "format": "date"}, "'format'"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "'oneOf'"),
    ({"allOf": [{"type": "string"}]}, "'allOf'"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"$ref": "#/$defs/x"}, "'$ref'"),
    ({"type": "array", "items": [{"type": "string"}]}, "items as a list"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties'"),
    ({"type": "object", "properties": {"a:b": {}}}, "property name 'a:b'"),
    ({"enum": ['a<|"|>b']}, 'marker <|"|>'),
    ({"type": "string", "enum": ["a"], "minLength": 2}, "'minLength' beside enum"),
    ({"type": "string", "anyOf": [{"maxLength": 2}]}, "'type' beside anyOf"),
    ({"type": "object", "required": ["x"]}, "'x' is not among properties"),
    ({"type": "string", "maxLength": 1, "minLength": 2}, "maxLength is below minLength"),
    ({"enum": [1, 2], "type": "string"}, "no value of enum"),
    (False, "false allows nothing"),
])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_schemas_it_cannot_hold_are_a_400_naming_them(schema, words: str, choice: str) -> None:
    tools = TOOLS + [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": schema}}}}]
    body = ChatRequest.model_validate({"messages": ASK, "tools": tools, "tool_choice": choice})
    with pytest.raises(ApiError) as caught:
        plan(body, FORMATS["gemma4"])
    assert caught.value.status == 400 and caught.value.param == "tools[3].function.parameters"
    assert "#/properties/p" in str(caught.value) and words in str(caught.value)


def _random_reply(vocab: Vocab, grammar: str, rng: np.random.Generator,
                  favoured: tuple[np.ndarray, np.ndarray], max_steps: int = 300
                  ) -> list[int] | None:
    """Tokens drawn at random from each step's mask (markers and one-character tokens
    favoured, so that values close) until the grammar ends or an end token is drawn; None
    when the walk runs past max_steps."""
    tok = vocab.tokenizer
    markers, short = favoured
    ends = np.array(sorted(tok.eot_ids))
    matcher = compile_constraint(vocab, grammar, GrammarLimits(), check=True).matcher
    ids: list[int] = []
    for _ in range(max_steps):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                             bitorder="little")[:tok.vocab_size].astype(bool)
        if matcher.is_stopped() or (bits[ends].any() and rng.random() < 0.15):
            return ids
        bits[ends] = False
        r = rng.random()
        for pool in ([bits & markers] if r < 0.3 else []) + ([bits & short] if r < 0.8
                                                             else []) + [bits]:
            if pool.any():
                break
        token = int(rng.choice(np.flatnonzero(pool)))
        assert matcher.consume_token(token)
        ids.append(token)
    return None


def test_random_walks_through_the_grammar_read_back_as_valid_calls(vocab: Vocab) -> None:
    """Every reply the grammar lets a sampler write parses: required, calls only, each of an
    offered function and valid; auto, text and then calls, the same."""
    tok, rng = vocab.tokenizer, np.random.default_rng(7)
    markers = np.zeros(tok.vocab_size, bool)
    markers[[tok.token_id(m) for m in MARKERS]] = True
    short = np.array([len(tok.token_to_piece(i)) == 1 for i in range(tok.vocab_size)])
    called: set[str] = set()
    for required, walks in ((True, 40), (False, 30)):
        grammar = _grammar(required, True)
        replies = [_random_reply(vocab, grammar, rng, (markers, short)) for _ in range(walks)]
        texts = [tok.decode(ids) for ids in replies if ids is not None]
        assert len(texts) > walks // 2
        for text in texts:
            if required or "<|tool_call>" in text:
                called |= {n for n, _ in _valid_calls(text)}
            else:
                assert not message(_plan(), text)[1]
    assert called == set(SCHEMAS)


@pytest.fixture(scope="module")
def g4_server(gguf_reader: gguf.GGUFReader, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("gemma4_tools")
    model = write_marked_gguf(gguf_reader, tmp / "marked.gguf")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    # NOTE: a mask inside a string value costs 3-4 ms of CPU here (the json format's 2-3 ms);
    # the wider budget is for this shared machine's load (load average 8 on 2 cores), not them
    s = start_server(model, tmp, ["--chat-template-file", str(template), "--api-key", API_KEY,
                                  "--max-num-seqs", "4", "--max-model-len", "1024",
                                  "--grammar-mask-ms", "500"])
    try:
        yield s
    finally:
        stop_server(s.proc)


@pytest.fixture(scope="module")
def client(g4_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=g4_server.url + "/v1", api_key=API_KEY, max_retries=0)


def _checked(calls: list) -> list[dict]:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [{"id": c.id, "type": "function", "function": {
        "name": c.function.name, "arguments": c.function.arguments}} for c in calls]


def test_required_call_and_its_answer(client: openai.OpenAI, g4_server: Server) -> None:
    """The 270M base model, which knows nothing of this syntax, calls under the grammar; the
    history goes back through the native template (arguments as objects)."""
    r = client.chat.completions.create(model=g4_server.model, messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=80).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None
    calls = _checked(r.message.tool_calls)
    assert len(calls) == 1
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                     {"role": "tool", "tool_call_id": calls[0]["id"], "content": "21 C"}]
    final = client.chat.completions.create(model=g4_server.model, messages=history,
                                           tools=TOOLS, tool_choice="none", temperature=0,
                                           max_tokens=8, extra_body={"verbose": True})
    prompt = final.model_extra["__verbose"]["prompt"]
    name, args = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
    assert f"<|tool_call>call:{name}{json.dumps(args)}<tool_call|>" in prompt
    assert f"{name} answered: 21 C" in prompt and final.choices[0].message.tool_calls is None


def test_named_function_with_samples_streamed_and_not(client: openai.OpenAI,
                                                      g4_server: Server) -> None:
    body = {"model": g4_server.model, "messages": ASK, "tools": TOOLS, "n": 3, "seed": 3,
            "temperature": 1.0, "max_tokens": 60, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = client.chat.completions.create(**body)
    assert [c.finish_reason for c in r.choices] == ["tool_calls"] * 3
    for c in r.choices:
        assert [call.function.name for call in c.message.tool_calls] == ["get_weather"]
        _checked(c.message.tool_calls)
    args: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **body):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                assert d.function.name in (None, "get_weather")
                args[ch.index] = args.get(ch.index, "") + (d.function.arguments or "")
    assert sorted(args) == [0, 1, 2]
    for text in args.values():
        jsonschema.validate(json.loads(text), WEATHER)


def test_auto_with_strict_is_held_once_a_call_opens(client: openai.OpenAI, g4_server: Server,
                                                    vocab: Vocab) -> None:
    """strict: true was a 400 before this format had a grammar. auto: the base model answers
    in text; pushed to open a call (a logit bias on <|tool_call>), the call is the grammar's."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}}
              for t in TOOLS]
    body = {"model": g4_server.model, "messages": ASK, "tools": strict, "max_tokens": 60,
            "temperature": 1.0, "seed": 4, "parallel_tool_calls": False}
    text = client.chat.completions.create(**body).choices[0]
    assert text.message.tool_calls is None and text.message.content
    assert not any(m in text.message.content for m in MARKERS)
    opened = vocab.tokenizer.token_id("<|tool_call>")
    r = client.chat.completions.create(**body, logit_bias={str(opened): 100}).choices[0]
    assert r.finish_reason == "tool_calls" and len(_checked(r.message.tool_calls)) == 1


def test_unholdable_schema_is_a_400_on_the_server(g4_server: Server) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "pattern": "^a"}}}}}]
    r = g4_server.client().post("/v1/chat/completions", json={
        "messages": ASK, "tools": tools, "tool_choice": "auto", "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools[0].function.parameters" and "'pattern'" in error["message"]
