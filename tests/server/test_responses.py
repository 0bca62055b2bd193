"""OpenAI's Responses API (/v1/responses, /responses) through the official openai client: the
same conversation answers as on the chat route."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import API_KEY, Server

INPUT = [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}]
CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_response_is_the_chat_reply(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model=server.model, input=INPUT, max_output_tokens=6,
                                temperature=0)
    chat = server.client().post("/v1/chat/completions", json={
        "model": server.model, "messages": CHAT, "max_tokens": 6, "temperature": 0}).json()
    assert r.id.startswith("resp_") and r.output[0].id.startswith("msg_")
    assert r.output_text == chat["choices"][0]["message"]["content"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        chat["usage"]["prompt_tokens"], 6)


def test_stream_events_build_the_same_response(client: openai.OpenAI, server: Server) -> None:
    whole = client.responses.create(model=server.model, input="Count: one, two",
                                    max_output_tokens=6, temperature=0)
    with client.responses.stream(model=server.model, input="Count: one, two",
                                 max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_telemetry_off_v1(server: Server) -> None:
    """llama-server's return_progress and timings_per_token on /responses."""
    with server.client().stream("POST", "/responses", json={
            "model": server.model, "input": "This is a test. " * 20, "max_output_tokens": 3,
            "stream": True, "return_progress": True, "timings_per_token": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"][
        "total"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in e["timings"] for e in deltas)
    assert events[-1]["type"] == "response.completed" and "timings" in events[-1]


def test_function_call_history_counts_as_the_chat_prompt(server: Server) -> None:
    tool = {"type": "function", "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    given = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    c = server.client()
    counted = c.post("/v1/responses/input_tokens", json={
        "model": server.model, "input": given, "tools": [tool]}).json()["input_tokens"]
    expected = c.post("/v1/chat/completions/input_tokens", json={
        "model": server.model, "messages": chat, "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": tool["parameters"]}}]}).json()["input_tokens"]
    assert counted == expected > 0


def test_what_it_cannot_carry_is_a_400(server: Server) -> None:
    c = server.client()
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    for body, param in (({"input": "Hi", "store": True}, "store"),
                        ({"input": "Hi", "previous_response_id": "resp_1"},
                         "previous_response_id"),
                        ({"input": image}, "input.0.content.0")):
        r = c.post("/v1/responses", json={"model": server.model, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
