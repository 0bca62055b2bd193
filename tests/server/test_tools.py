"""Tool calling on a real server through the official openai client: a two-turn tool loop
(call, tool result, final answer), streamed and not, every call validated against its
function's schema with jsonschema; named functions, n > 1, parallel_tool_calls; the embedded
270M base model cannot call tools unaided, so every call here is the grammar's doing."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, Server

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 20},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]}},
    "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather of a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK,
                                           "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _valid(calls: list, names: frozenset[str] = frozenset(SCHEMAS)) -> list[dict]:
    """Each call names an offered function and its arguments hold that function's schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [{"id": c.id, "type": "function", "function": {
        "name": c.function.name, "arguments": c.function.arguments}} for c in calls]


def _streamed(client: openai.OpenAI, **body) -> tuple[dict[int, dict], list[str | None]]:
    """-> each choice's content and calls put together from the deltas, the finish reasons;
    asserts OpenAI's delta shape (id, type and name first, argument fragments after)."""
    got: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **body):
        for ch in chunk.choices:
            choice = got.setdefault(ch.index, {"content": "", "calls": {}, "reason": None})
            choice["content"] += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.index not in choice["calls"]:
                    assert d.id and d.type == "function" and d.function.name
                    assert d.function.arguments == ""
                    choice["calls"][d.index] = {"id": d.id, "name": d.function.name, "args": ""}
                else:
                    assert d.id is None and d.function.name is None
                    choice["calls"][d.index]["args"] += d.function.arguments
            if ch.finish_reason:
                choice["reason"] = ch.finish_reason
    return got, [got[i]["reason"] for i in sorted(got)]


def test_two_turn_tool_loop(client: openai.OpenAI, server: Server) -> None:
    r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    # NOTE: Gemma 3's template has no thinking channel: no reasoning_content
    assert "reasoning_content" not in (choice.message.model_extra or {})
    calls = _valid(choice.message.tool_calls)
    assert len(calls) == 1
    result = {"role": "tool", "tool_call_id": calls[0]["id"],
              "content": json.dumps({"temperature": 21, "sky": "clear"})}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls}, result]
    final = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=24,
                                           extra_body={"verbose": True})
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    prompt = final.model_extra["__verbose"]["prompt"]
    assert '"response": {"temperature": 21, "sky": "clear"}' in prompt
    assert '{"name":"' + calls[0]["function"]["name"] + '","parameters":' in prompt
    # NOTE: auto: the history's call makes this model open another, held to the grammar
    auto = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS,
                                          parallel_tool_calls=False, temperature=0,
                                          max_tokens=60).choices[0]
    assert auto.finish_reason == "tool_calls"
    _valid(auto.message.tool_calls)


def test_auto_mode_answers_in_text(client: openai.OpenAI, server: Server) -> None:
    """auto: a reply that does not open with "{" is content, as the model wrote it."""
    r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                       temperature=0, max_tokens=12).choices[0]
    assert r.message.tool_calls is None and r.message.content
    assert not r.message.content.lstrip().startswith("{")


def test_two_turn_tool_loop_streamed(client: openai.OpenAI, server: Server) -> None:
    body = {"model": server.model, "tools": TOOLS, "temperature": 0, "max_tokens": 60}
    got, reasons = _streamed(client, messages=ASK, tool_choice="required",
                             parallel_tool_calls=False, **body)
    assert reasons == ["tool_calls"] and got[0]["content"] == ""
    (call,) = got[0]["calls"].values()
    jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])
    plain = client.chat.completions.create(messages=ASK, tool_choice="required",
                                           parallel_tool_calls=False, **body).choices[0]
    assert plain.message.tool_calls[0].function.arguments == call["args"]
    history = ASK + [{"role": "assistant", "tool_calls": [{"id": call["id"], "type": "function",
                     "function": {"name": call["name"], "arguments": call["args"]}}]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "21 C, clear"}]
    got, reasons = _streamed(client, messages=history, tool_choice="none",
                             **{**body, "max_tokens": 16})
    assert got[0]["content"] and not got[0]["calls"] and reasons[0] in ("stop", "length")


def test_named_function_with_samples(client: openai.OpenAI, server: Server) -> None:
    """n = 3 seeded samples, unstreamed and streamed: every call is of the named function."""
    body = {"model": server.model, "messages": ASK, "tools": TOOLS, "n": 3, "seed": 11,
            "temperature": 1.0, "max_tokens": 40, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    r = client.chat.completions.create(**body)
    assert [c.finish_reason for c in r.choices] == ["tool_calls"] * 3
    for c in r.choices:
        _valid(c.message.tool_calls, frozenset({"get_time"}))
    got, reasons = _streamed(client, **body)
    assert reasons == ["tool_calls"] * 3
    for i in range(3):
        (call,) = got[i]["calls"].values()
        assert call["name"] == "get_time"
        jsonschema.validate(json.loads(call["args"]), CLOCK)


def test_parallel_calls_each_validate(client: openai.OpenAI, server: Server) -> None:
    """parallel_tool_calls on: one or more calls; a reply cut off by max_tokens inside a call
    is content, its finish reason "length"."""
    r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                       tool_choice="required", temperature=1.0, seed=5, n=2,
                                       max_tokens=120)
    for c in r.choices:
        if c.finish_reason == "tool_calls":
            _valid(c.message.tool_calls)
        else:
            assert c.finish_reason == "length" and c.message.tool_calls is None
            assert c.message.content.startswith('{"name":"')


def test_tool_fields_are_checked(server: Server) -> None:
    c = server.client()
    url = "/v1/chat/completions"
    base = {"messages": ASK, "max_tokens": 4}
    for fields, param in [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "array"}}}]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "$ref": "#"}}}]}, "tools[0].function.parameters"),
        ({"messages": ASK + [{"role": "tool", "tool_call_id": "x", "content": "1"}]},
         "messages[1].tool_call_id"),
    ]:
        r = c.post(url, json={**base, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
