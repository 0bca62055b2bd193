"""Structured output on a real server: every output of a JSON-schema request validates against
its schema (greedy and seeded sampling, the official openai client and plain HTTP), GBNF
grammars hold, a grammar that does not compile is a 400 naming its field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, Server

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "member": {"type": "boolean"}},
    "required": ["name", "age", "member"], "additionalProperties": False}
COLORS = {"type": "object", "properties": {
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
               "minItems": 1, "maxItems": 3}},
    "required": ["colors"], "additionalProperties": False}
NESTED = {"type": "object", "$defs": {"point": {"type": "object", "properties": {
    "x": {"type": "integer", "minimum": -9, "maximum": 9},
    "y": {"type": "integer", "minimum": -9, "maximum": 9}},
    "required": ["x", "y"], "additionalProperties": False}},
    "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
    "required": ["start", "end"], "additionalProperties": False}
CHOICE = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "string", "enum": ["none", "many"]}]}
SCHEMAS = {"person": PERSON, "colors": COLORS, "nested": NESTED, "choice": CHOICE}
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 7}}
ASK = [{"role": "user", "content": "Answer in JSON: describe something."}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _chat(client: openai.OpenAI, model: str, schema: dict, sampling: dict) -> tuple[str, str]:
    r = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=160, **sampling,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_every_json_schema_output_validates(client: openai.OpenAI, server: Server) -> None:
    """Four schemas x greedy / seeded, sent together (constrained rows share steps with each
    other and with an unconstrained request, whose text is the same as when it runs alone)."""
    plain = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 12,
             "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**plain).choices[0].text
    jobs = [(s, m) for s in SCHEMAS for m in SAMPLINGS]
    with ThreadPoolExecutor(4) as pool:
        mixed = pool.submit(lambda: client.completions.create(**plain).choices[0].text)
        outs = list(pool.map(lambda j: _chat(client, server.model, SCHEMAS[j[0]],
                                             SAMPLINGS[j[1]]), jobs))
    for (schema, sampling), (text, reason) in zip(jobs, outs):
        assert reason == "stop", (schema, sampling, text)
        jsonschema.validate(json.loads(text), SCHEMAS[schema])
    assert mixed.result() == alone


def test_streamed_json_schema_output_validates(client: openai.OpenAI, server: Server) -> None:
    chunks = list(client.chat.completions.create(
        model=server.model, messages=ASK, max_tokens=160, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_a_json_object(client: openai.OpenAI, server: Server) -> None:
    r = client.completions.create(model=server.model, prompt="A JSON object:", max_tokens=200,
                                  temperature=1.0, seed=3,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_llama_completion_json_schema_and_gbnf(server: Server) -> None:
    c = server.client()
    r = c.post("/completion", json={"prompt": "Colors:", "n_predict": 120, "temperature": 0,
                                    "json_schema": COLORS})
    assert r.status_code == 200 and r.json()["stop_type"] == "eos", r.text
    jsonschema.validate(json.loads(r.json()["content"]), COLORS)
    gbnf = 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]?\n'
    for seed in (1, 2, 3):
        r = c.post("/completion", json={"prompt": "Is it?", "n_predict": 20, "seed": seed,
                                        "temperature": 1.0, "grammar": gbnf})
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"(yes|no) [1-9][0-9]?", r.json()["content"]), r.json()["content"]


def test_chat_grammar_field_on_the_llama_route(server: Server) -> None:
    r = server.client().post("/chat/completions", json={
        "messages": ASK, "max_tokens": 10, "temperature": 0, "grammar": 'root ::= "A" | "B"'})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("A", "B")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "a(?=b)"}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": "a"}}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"response_format": {"type": "json_object", "schema": {"enum": []}}},
     "response_format"),
    ("/completion", {"json_schema": {"$ref": "#/$defs/missing"}}, "json_schema"),
    ("/completion", {"grammar": "root ::= [a-"}, "grammar"),
    ("/completion", {"grammar": "rot ::= \"a\""}, "grammar"),
    ("/completion", {"grammar": "root ::= \"a\"", "json_schema": {}}, "grammar"),
])
def test_a_schema_or_grammar_that_does_not_compile_is_a_400(
        server: Server, path: str, body: dict, param: str) -> None:
    base = ({"prompt": "Hi", "n_predict": 2} if path == "/completion" else
            {"prompt": "Hi"} if path == "/v1/completions" else {"messages": ASK})
    r = server.client().post(path, json=base | body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, r.text
    assert param.split(".")[0] in err["message"]


def test_every_sample_of_n_keeps_to_the_schema(client: openai.OpenAI, server: Server) -> None:
    """n samples fork from one prefill; each walks a grammar of its own, so every choice
    validates, and the seeded samples differ."""
    r = client.chat.completions.create(
        model=server.model, messages=ASK, max_tokens=160, temperature=1.0, seed=3, n=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": PERSON, "strict": True}})
    assert len(r.choices) == 3 and r.usage.prompt_tokens > 0
    texts = []
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.append(choice.message.content)
    assert len(set(texts)) > 1, texts
