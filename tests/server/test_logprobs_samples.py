"""Logprobs, echo, n / best_of and llama.cpp's n_probs and penalties, through the official openai
client (OpenAI routes) and plain HTTP (llama.cpp's), streaming and not."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import API_KEY, MAX_MODEL_LEN, Server

PROMPT = "The capital of France is"
STORY = "Once upon a time, in a small village by the sea,"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _ids(server: Server, text: str) -> list[int]:
    return server.client().post("/tokenize", json={"content": text, "add_special": True}
                                ).json()["tokens"]


def test_completion_logprobs_and_their_stream(client: openai.OpenAI, server: Server) -> None:
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6,
                                  temperature=0, logprobs=3, extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4  # the 3 best and the chosen token
        assert max(top, key=top.get) == token and top[token] == value  # greedy
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6,
                                            temperature=0, logprobs=3, extra_body=NO_EOS,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs
                and c.choices[0].logprobs.tokens]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt_as_lm_eval_asks(
        client: openai.OpenAI, server: Server) -> None:
    greedy = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                       temperature=0, extra_body=NO_EOS, logprobs=1)
    continued = _ids(server, PROMPT) + _ids(server, greedy.choices[0].text)[1:]
    for body in ({"prompt": continued}, {"prompt": continued, "stream": True}):
        r = client.completions.create(model=server.model, max_tokens=0, temperature=0,
                                      logprobs=1, echo=True, seed=1234, **body)
        if body.get("stream"):
            chunks = list(r)
            assert chunks[-1].choices[0].finish_reason == "length"
            lp = chunks[0].choices[0].logprobs
            text = "".join(c.choices[0].text for c in chunks)
        else:
            assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(continued)
            lp, text = r.choices[0].logprobs, r.choices[0].text
        assert text.endswith(greedy.choices[0].text)
        assert len(lp.token_logprobs) == len(continued) and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
        # the continuation's tokens were the greedy ones: each its position's best
        tail = len(continued) - len(greedy.choices[0].logprobs.tokens)
        for token, top in zip(lp.tokens[tail:], lp.top_logprobs[tail:]):
            assert max(top, key=top.get) == token


def test_a_batch_of_token_prompts_scored_as_lm_eval_sends_it(
        client: openai.OpenAI, server: Server) -> None:
    """lm-eval's local-completions: a list of token-id prompts, echo, logprobs=1, max_tokens 0;
    choice i is prompt i's, each as if sent alone."""
    prompts = [_ids(server, PROMPT), _ids(server, STORY)]
    args = {"model": server.model, "max_tokens": 0, "temperature": 0, "logprobs": 1,
            "echo": True}
    r = client.completions.create(prompt=prompts, **args)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 0
    for ids, c in zip(prompts, r.choices):
        alone = client.completions.create(prompt=ids, **args).choices[0]
        assert c.logprobs.token_logprobs == alone.logprobs.token_logprobs
        assert len(c.logprobs.tokens) == len(ids) and c.text == alone.text
    texts = client.completions.create(model=server.model, prompt=[PROMPT, STORY], n=2,
                                      max_tokens=3, temperature=0)
    assert [c.index for c in texts.choices] == [0, 1, 2, 3]
    assert texts.choices[0].text == texts.choices[1].text != texts.choices[2].text


def test_n_samples_each_as_its_own_seed_would_draw(client: openai.OpenAI,
                                                   server: Server) -> None:
    args = {"model": server.model, "prompt": STORY, "max_tokens": 5, "temperature": 1.0,
            "extra_body": NO_EOS}
    r = client.completions.create(n=3, seed=41, **args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(_ids(server, STORY))  # the prompt counted once
    assert r.usage.completion_tokens == 15
    alone = [client.completions.create(seed=41 + i, **args).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == alone
    chunks = list(client.completions.create(n=3, seed=41, stream=True, **args))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
             for i in range(3)}
    assert list(texts.values()) == alone
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2]


def test_best_of_keeps_the_samples_of_highest_mean_logprob(client: openai.OpenAI,
                                                           server: Server) -> None:
    args = {"model": server.model, "prompt": STORY, "max_tokens": 5, "temperature": 1.0,
            "seed": 5, "extra_body": NO_EOS}
    every = client.completions.create(n=4, logprobs=0, **args).choices
    mean = {c.text: sum(c.logprobs.token_logprobs) / 5 for c in every}
    kept = client.completions.create(n=2, best_of=4, **args)
    assert [c.text for c in kept.choices] == sorted(mean, key=mean.get, reverse=True)[:2]
    assert kept.choices[0].logprobs is None and kept.usage.completion_tokens == 20


def test_chat_logprobs_top_logprobs_and_n(client: openai.OpenAI, server: Server) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.logprob == t.top_logprobs[0].logprob and bytes(t.bytes) == t.token.encode()
    chunks = list(client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(model=server.model, messages=messages, max_tokens=4,
                                           temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_malformed_samples_and_logprobs_are_400_naming_the_field(
        client: openai.OpenAI, server: Server) -> None:
    for param, kwargs in [("n", {"n": 99}), ("logprobs", {"logprobs": 21}),
                          ("best_of", {"n": 3, "best_of": 2}),
                          ("max_tokens", {"max_tokens": 0})]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=server.model, prompt="x", **{"max_tokens": 1,
                                                                        **kwargs})
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, max_tokens=1, top_logprobs=2,
                                       messages=[{"role": "user", "content": "x"}])
    assert err.value.body["param"] == "top_logprobs"
    assert client.completions.create(model=server.model, prompt="x", max_tokens=1).choices


def test_llama_n_probs_in_llama_cpp_shape(server: Server) -> None:
    c = server.client()
    body = {"prompt": PROMPT, "n_probs": 4, "temperature": 0, "n_predict": 5,
            "ignore_eos": True}
    r = c.post("/completion", json=body).json()
    probs = r["completion_probabilities"]
    assert len(probs) == 5 and r["generation_settings"]["n_probs"] == 4
    assert "".join(p["token"] for p in probs) == r["content"]
    for p in probs:
        assert set(p) == {"id", "token", "logprob", "bytes", "top_logprobs"}
        assert p["logprob"] <= 0 and bytes(p["bytes"]).decode() == p["token"]
        assert len(p["top_logprobs"]) == 4 and p["top_logprobs"][0]["id"] == p["id"]
        assert set(p["top_logprobs"][0]) == {"id", "token", "logprob", "bytes"}
    with c.stream("POST", "/completion", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    streamed = [e["completion_probabilities"] for e in events if not e["stop"]]
    assert all(len(p) == 1 for p in streamed) and [p[0] for p in streamed] == probs
    assert "completion_probabilities" not in c.post("/completion", json={
        **body, "n_probs": 0}).json()


def test_llama_presence_and_frequency_penalties_are_honoured(server: Server) -> None:
    """llama.cpp's scope: counts over the last repeat_last_n ids of prompt + output (-1: the
    context); a greedy loop of repeated words is broken."""
    c = server.client()
    body = {"prompt": "one two one two one two one two one two", "n_predict": 16,
            "temperature": 0, "ignore_eos": True}
    plain = c.post("/completion", json=body).json()
    same = c.post("/completion", json={**body, "presence_penalty": 0.0,
                                       "frequency_penalty": 0.0}).json()
    assert same["content"] == plain["content"]
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0, "repeat_last_n": -1}):
        r = c.post("/completion", json={**body, **extra}).json()
        assert r["content"] != plain["content"], extra
        settings = r["generation_settings"]
        for key, value in extra.items():
            assert settings[key] == (MAX_MODEL_LEN if value == -1 else value)
    # NOTE: repeat_last_n 0 turns every penalty off, as in llama.cpp
    off = c.post("/completion", json={**body, "presence_penalty": 2.0, "repeat_last_n": 0})
    assert off.json()["content"] == plain["content"]
