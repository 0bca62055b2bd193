"""OpenAI routes through the official openai client, streaming and not."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import API_KEY, Server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list()] == [server.model]


def test_completion_text_and_usage(client: openai.OpenAI, server: Server) -> None:
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6,
                                  temperature=0)
    num_prompt = len(server.client().post("/tokenize", json={
        "content": PROMPT, "add_special": True}).json()["tokens"])
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.choices[0].text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (num_prompt, 6)
    assert r.usage.total_tokens == num_prompt + 6


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI, server: Server) -> None:
    whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6,
                                      temperature=0)
    chunks = list(client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_token_id_prompt(client: openai.OpenAI, server: Server) -> None:
    ids = server.client().post("/tokenize", json={"content": PROMPT, "add_special": True}).json()
    by_ids = client.completions.create(model=server.model, prompt=ids["tokens"], max_tokens=4,
                                       temperature=0)
    by_text = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                        temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_completion_and_stream(client: openai.OpenAI, server: Server) -> None:
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=5,
                                           temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert 1 <= whole.usage.completion_tokens <= 5
    chunks = list(client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_unknown_model_is_404_with_openai_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"


def test_bad_sampling_value_is_400(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt="x", max_tokens=1, top_p=1.5)
    assert err.value.body["param"] == "top_p"


def test_frequency_and_presence_penalties_change_a_repetitive_greedy_text(
        client: openai.OpenAI, server: Server) -> None:
    """OpenAI's penalties over the generated tokens: a greedy loop of repeated tokens is broken
    (each repeat lowers the token's logit), and the text without penalties is unchanged."""
    prompt = "one two one two one two one two one two one two"

    def tokens(**penalties) -> list[str]:
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=24,
                                      temperature=0, **penalties)
        return r.choices[0].text.split()

    plain = tokens()
    assert plain == tokens(frequency_penalty=0.0, presence_penalty=0.0)
    penalized = tokens(frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))
