"""Anthropic's Messages API (/v1/messages, count_tokens) through the official anthropic client:
the same conversation answers as on the chat route."""

from __future__ import annotations

import anthropic
import pytest

from tests.server.conftest import API_KEY, Server

TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}
# NOTE: the anthropic client has no temperature argument; the API takes the field
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def _chat(server: Server, messages: list[dict], max_tokens: int) -> dict:
    r = server.client().post("/v1/chat/completions", json={
        "model": server.model, "messages": messages, "max_tokens": max_tokens, **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def test_reply_is_the_chat_reply(client: anthropic.Anthropic, server: Server) -> None:
    m = client.messages.create(model=server.model, max_tokens=6, extra_body=GREEDY,
                               system="Answer briefly.",
                               messages=[{"role": "user", "content": "Name a colour."}])
    chat = _chat(server, [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": "Name a colour."}], 6)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
    assert (m.usage.input_tokens + m.usage.cache_read_input_tokens
            == chat["usage"]["prompt_tokens"])


def test_stream_events_carry_the_same_text(client: anthropic.Anthropic, server: Server) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Count:"},
                                             {"type": "text", "text": "one, two"}]}]
    whole = client.messages.create(model=server.model, max_tokens=6, extra_body=GREEDY,
                                   messages=messages)
    with client.messages.stream(model=server.model, max_tokens=6, extra_body=GREEDY,
                                messages=messages) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_count_tokens_of_a_tool_history_is_the_chat_prompts(client: anthropic.Anthropic,
                                                             server: Server) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "call_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny, 25 C"}]}]
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 C"}]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": TOOL["description"],
        "parameters": TOOL["input_schema"]}}]
    counted = client.messages.count_tokens(model=server.model, messages=history, tools=[TOOL])
    expected = server.client().post("/v1/chat/completions/input_tokens", json={
        "model": server.model, "messages": chat, "tools": tools}).json()["input_tokens"]
    assert counted.input_tokens == expected > 0


def test_shapes_it_cannot_carry_are_400s(server: Server) -> None:
    c = server.client()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    for body, param, words in (
            ({"messages": [{"role": "user", "content": [image]}]}, "messages.0.content.0",
             "image input is not supported"),
            ({"max_tokens": 5}, "messages", "required"),
            ({"messages": [], "betas": ["x"]}, "betas", "unknown field")):
        r = c.post("/v1/messages", json={"model": server.model, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_an_empty_conversation_is_answered(client: anthropic.Anthropic, server: Server) -> None:
    m = client.messages.create(model=server.model, max_tokens=3, messages=[])
    assert m.usage.output_tokens >= 1 and m.content[0].type == "text"
