"""llama-server's HTTP contract on a server started the way a llama-server user would run it:
alias routes, any model name, its fields, framing, errors, CORS, templates, defaults."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import Server, start_server, stop_server

CTX = 64
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def compat(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("compat")
    (tmp / "chat.jinja").write_text(TEMPLATE)
    s = start_server(gguf_path, tmp, [
        "--max-model-len", str(CTX), "--max-num-seqs", "2", "--model-name", "muser-test,other",
        "--seed", "7", "--temp", "0.5", "--cors-origins", "localhost,https://app.example",
        "--chat-template-file", str(tmp / "chat.jinja"), "--no-slots", "--no-metrics"])
    try:
        yield s
    finally:
        stop_server(s.proc)


def _sse(c: httpx.Client, path: str, body: dict) -> list[dict]:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" if path != "/completion" else True
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_alias_routes_answer_like_their_targets(compat: Server) -> None:
    c = compat.client(key=None)
    body = {"prompt": "The sky is", "n_predict": 3, "temperature": 0}
    assert c.post("/completions", json=body).json()["content"] == c.post(
        "/completion", json=body).json()["content"]
    chat = c.post("/chat/completions", json={"messages": CHAT, "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 2
    assert c.get("/models").json() == c.get("/v1/models").json()
    assert c.get("/v1/health").json() == {"status": "ok"}


def test_any_model_name_is_served_and_aliases_are_listed(compat: Server) -> None:
    c = compat.client(key=None)
    r = c.post("/v1/completions", json={"model": "gpt-3.5-turbo", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "muser-test"
    assert r.json()["system_fingerprint"].startswith("b")
    [model] = c.get("/v1/models").json()["data"]
    assert model["id"] == "muser-test" and model["aliases"] == ["muser-test", "other"]


def test_completion_fields_timings_and_response_fields(compat: Server) -> None:
    c = compat.client(key=None)
    body = {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0, "ignore_eos": True}
    r = c.post("/completion", json={**body, "return_tokens": True}).json()
    assert {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted",
            "tokens_evaluated", "generation_settings", "prompt", "has_new_line", "truncated",
            "stop_type", "stopping_word", "tokens_cached", "timings"} <= set(r)
    assert len(r["tokens"]) == 4 and c.post("/detokenize", json={
        "tokens": r["tokens"]}).json()["content"] == r["content"]
    assert r["prompt"] == "<bos>Once upon a time" and r["has_new_line"] == ("\n" in r["content"])
    assert r["tokens_cached"] == r["tokens_evaluated"] + 4 and r["truncated"] is False
    t = r["timings"]
    assert list(t) == ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms",
                       "prompt_per_second", "predicted_n", "predicted_ms",
                       "predicted_per_token_ms", "predicted_per_second"]
    assert t["prompt_n"] == r["tokens_evaluated"] and t["predicted_n"] == 4
    assert t["predicted_per_second"] == pytest.approx(3e3 / t["predicted_ms"])
    assert r["generation_settings"]["logit_bias"] != [] and r["generation_settings"]["seed"] == 7
    picked = c.post("/completion", json={**body, "response_fields": [
        "content", "generation_settings/n_predict", "nope"]}).json()
    assert picked == {"content": r["content"], "generation_settings/n_predict": 4}


def test_stop_word_and_truncation_at_the_full_context(compat: Server) -> None:
    c = compat.client(key=None)
    base = {"prompt": "1, 2, 3, 4,", "temperature": 0, "ignore_eos": True}
    free = c.post("/completion", json={**base, "n_predict": 12}).json()["content"]
    word = free.strip()[:2]
    r = c.post("/completion", json={**base, "n_predict": 12, "stop": [word]}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == word
    full = c.post("/completion", json={**base, "n_predict": 10**6}).json()
    assert full["truncated"] is True and full["stop_type"] == "limit"
    assert full["tokens_evaluated"] + full["tokens_predicted"] == CTX


def test_streams_frame_as_llama_server_off_v1_and_as_openai_on_v1(compat: Server) -> None:
    c = compat.client(key=None)
    events = _sse(c, "/completion", {"prompt": "Hello", "n_predict": 3, "temperature": 0})
    assert [e["stop"] for e in events] == [False, False, False, True]
    assert events[-1]["content"] == "" and events[-1]["tokens_predicted"] == 3
    chunks = _sse(c, "/chat/completions", {"messages": CHAT, "max_tokens": 3,
                                           "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all("content" in ch["choices"][0]["delta"] for ch in chunks[1:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["timings"]["predicted_n"] == 3
    assert all(ch["system_fingerprint"].startswith("b") for ch in chunks)
    raw = _sse(c, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3})
    assert raw[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    client = openai.OpenAI(base_url=compat.url + "/v1", api_key="none", max_retries=0)
    parts = list(client.completions.create(model="davinci-002", prompt="Hello", max_tokens=3,
                                           temperature=0, stream=True))
    assert [p.choices[0].finish_reason for p in parts] == [None] * (len(parts) - 1) + ["length"]
    assert parts[-1].choices[0].text == ""
    whole = client.completions.create(model="x", prompt="Hello", max_tokens=3, temperature=0)
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text


def test_context_overflow_error_shapes(compat: Server) -> None:
    c = compat.client(key=None)
    long = "word " * CTX
    for path, body in (("/completion", {"prompt": long}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": long}]}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": long}],
                                              "stream": True})):
        r = c.post(path, json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "exceed_context_size_error", r.text
        assert err["n_prompt_tokens"] > CTX and err["n_ctx"] == CTX
    r = c.post("/v1/completions", json={"prompt": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path,field,value", [
    ("/completion", "logit_bias", [[15, "x"]]), ("/completion", "logit_bias", [[10**9, -1]]),
    ("/completion", "logit_bias", [[15]]), ("/v1/completions", "logit_bias", {"the": 1}),
    ("/v1/completions", "logit_bias", {"15": 101}), ("/completion", "grammar", "root ::= [a-"),
    ("/chat/completions", "grammar", "root ::= undefined-rule"),
    ("/chat/completions", "json_schema", {"type": "integer", "minimum": "zero"}),
    ("/chat/completions", "response_format", {"type": "sound"}),
    ("/completion", "id_slot", 2), ("/chat/completions", "id_slot", 2),
    ("/completion", "top_k", 2.5), ("/completion", "mirostat", 2),
    ("/completion", "no_such_field", 1), ("/chat/completions", "no_such_field", 1)])
def test_unsupported_fields_are_refused_by_name(compat: Server, path: str, field: str,
                                                value: object) -> None:
    body = ({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else
            {"prompt": "Hi"}) | {field: value}
    r = compat.client(key=None).post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_n_predict_on_the_openai_routes(compat: Server) -> None:
    """llama-server's n_predict overrides max_tokens there too; -1 or more than fits is the
    context's rest (a finish of "length")."""
    c = compat.client(key=None)
    r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 9, "n_predict": 3})
    assert r.json()["usage"]["completion_tokens"] == 3
    for n_predict in (-1, 10 * CTX):
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "n_predict": n_predict,
                                                 "ignore_eos": True}).json()
        assert r["usage"]["total_tokens"] == CTX and r["choices"][0]["finish_reason"] == "length"


def test_backend_sampling_gives_the_same_tokens(compat: Server) -> None:
    c = compat.client(key=None)
    body = {"prompt": "Hello", "n_predict": 4, "n_probs": 3, "seed": 5}
    on, off = (c.post("/completion", json=body | {"backend_sampling": b}).json()
               for b in (True, False))
    assert on["completion_probabilities"] == off["completion_probabilities"]


def test_logit_bias_in_each_form(compat: Server) -> None:
    """A banned token is never chosen, whether named by id (false or -100) or by a text, in
    llama-server's pairs, its object, or OpenAI's object; a bias shows in generation_settings."""
    c = compat.client(key=None)
    base = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0,
            "ignore_eos": True, "return_tokens": True}
    free = c.post("/completion", json=base).json()
    first = free["tokens"][0]
    piece = c.post("/detokenize", json={"tokens": [first]}).json()["content"]
    for bias in ([[first, False]], [[first, -100]], {str(first): False}, [[piece, False]]):
        r = c.post("/completion", json={**base, "logit_bias": bias}).json()
        assert first not in r["tokens"], (bias, r["content"])
    settings = r["generation_settings"]["logit_bias"]
    assert {"token": first, "bias": None} in settings
    zebra = c.post("/tokenize", json={"content": " zebra"}).json()["tokens"][-1]
    openai = c.post("/v1/completions", json={"prompt": base["prompt"], "max_tokens": 3,
                                             "temperature": 0, "logit_bias": {str(zebra): 100}})
    assert openai.status_code == 200, openai.text
    assert openai.json()["choices"][0]["text"] == c.post("/detokenize", json={
        "tokens": [zebra] * 3}).json()["content"]
    same = c.post("/completion", json={**base, "logit_bias": [[first + 1, 0.0]]}).json()
    assert same["tokens"] == free["tokens"]  # a zero bias changes nothing


def test_whole_floats_are_integers(compat: Server) -> None:
    r = compat.client(key=None).post("/completion", json={"prompt": "Hi", "n_predict": 1,
                                                          "top_k": 40.0})
    assert r.status_code == 200 and r.json()["generation_settings"]["top_k"] == 40


@pytest.mark.parametrize("origin,allowed", [
    ("http://localhost", True), ("http://127.0.0.1:3000", True), ("http://[::1]:8080", True),
    ("https://app.example", True), ("http://localhost.evil.com", False),
    ("http://evil.com", False), ("https://app.example.org", False)])
def test_cors_preflight_and_origins(compat: Server, origin: str, allowed: bool) -> None:
    c = compat.client(key=None)
    r = c.options("/completions", headers={"Origin": origin,
                                           "Access-Control-Request-Method": "POST",
                                           "Access-Control-Request-Headers": "Authorization"})
    assert r.status_code == 200
    assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    names = {name for name, _ in r.headers.raw}  # NOTE: as sent; llama-server's casing
    assert b"Access-Control-Allow-Methods" in names
    assert (b"Access-Control-Allow-Origin" in names) == allowed
    simple = c.get("/health", headers={"Origin": origin})
    assert simple.headers.get("access-control-allow-origin") == (origin if allowed else None)


def test_custom_chat_template_and_apply_template(compat: Server) -> None:
    c = compat.client(key=None)
    prompt = c.post("/apply-template", json={"messages": CHAT}).json()["prompt"]
    assert prompt == "[system] Be brief.\n[user] Hi there\n[assistant] "
    bare = c.post("/apply-template", json={"messages": CHAT, "add_generation_prompt": False})
    assert bare.json()["prompt"] == "[system] Be brief.\n[user] Hi there\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Wh"},
                                          {"type": "text", "text": "ill"}]}]
    joined = c.post("/apply-template", json={"messages": parts, "add_generation_prompt": False})
    assert joined.json()["prompt"] == "[user] Wh\n\nill\n"  # llama-server's blank line
    developer = [{**m, "role": "developer"} if m["role"] == "system" else m for m in CHAT]
    assert developer != CHAT  # OpenAI's 'developer' turn is the template's system turn
    assert c.post("/apply-template", json={"messages": developer}).json()["prompt"] == prompt
    reply = c.post("/chat/completions", json={"messages": developer, "max_tokens": 1,
                                              "verbose": True}).json()
    assert reply["__verbose"]["prompt"] == prompt
    assert c.get("/props").json()["chat_template"] == TEMPLATE
    ids = c.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
    chat = c.post("/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)


def test_several_prompts_and_token_prompts(compat: Server) -> None:
    c = compat.client(key=None)
    ids = c.post("/tokenize", json={"content": "The sky is", "add_special": True}).json()["tokens"]
    body = {"n_predict": 3, "temperature": 0}
    one = c.post("/completion", json={**body, "prompt": "The sky is"}).json()
    both = c.post("/completion", json={**body, "prompt": ["The sky is", ids]}).json()
    assert [r["index"] for r in both] == [0, 1]
    assert [r["content"] for r in both] == [one["content"]] * 2
    # ids and text in one sequence: a text that is not the first part gets no BOS
    mixed = c.post("/completion", json={**body, "prompt": [ids[0], "The sky is"]}).json()
    assert mixed["tokens_evaluated"] == len(ids) and mixed["content"] == one["content"]
    r = c.post("/completion", json={**body, "prompt": ["a", "b"], "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_server_defaults_and_switches(compat: Server) -> None:
    c = compat.client(key=None)
    params = c.get("/props").json()["default_generation_settings"]["params"]
    assert (params["seed"], params["temperature"]) == (7, 0.5)
    r = c.post("/completion", json={"prompt": "Hi", "n_predict": 1}).json()
    assert r["generation_settings"]["seed"] == 7
    assert r["generation_settings"]["temperature"] == 0.5
    assert c.get("/slots").status_code == 501 and c.get("/metrics").status_code == 501


def test_llamacpp_metric_families(server: Server) -> None:
    """Prompt tokens as llama-server counts them: computed, and apart those the prefix cache
    held (the same prompt sent again computes only its last)."""
    c = server.client()
    timings = [c.post("/completion", json={"prompt": "Hello there, keeper", "n_predict": 2,
                                           "temperature": 0}).json()["timings"]
               for _ in range(2)]
    assert timings[1]["cache_n"] == timings[0]["prompt_n"] - 1 and timings[1]["prompt_n"] == 1
    text = c.get("/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("llamacpp:")}
    computed, cached = values["llamacpp:prompt_tokens_total"], values[
        "llamacpp:prompt_tokens_cached_total"]
    assert computed + cached == server.metric("muser_prompt_tokens_total")
    assert cached >= timings[1]["cache_n"] > 0
    assert values["llamacpp:tokens_predicted_total"] == server.metric(
        "muser_generation_tokens_total")
    assert values["llamacpp:n_decode_total"] > 0 and values["llamacpp:prompt_seconds_total"] > 0
    assert "# TYPE llamacpp:n_tokens_max counter" in text
    assert "# TYPE llamacpp:requests_processing gauge" in text


def test_two_assistant_turns_at_the_end_are_refused_off_v1(compat: Server) -> None:
    c = compat.client(key=None)
    two = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"},
           {"role": "assistant", "content": "B"}]
    r = c.post("/chat/completions", json={"messages": two, "max_tokens": 1})
    assert r.status_code == 400 and "2 or more assistant" in r.json()["error"]["message"]
    assert c.post("/v1/chat/completions", json={"messages": two, "max_tokens": 1}).status_code == 200


def test_n_predict_beyond_the_server_default(gguf_path: Path,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """--n-predict is the default of a request that leaves n_predict out, not a cap (as in
    llama-server, whose tests ask 80 tokens of a server started with --n-predict 64)."""
    s = start_server(gguf_path, tmp_path_factory.mktemp("n_predict"),
                     ["--max-model-len", "256", "--max-num-seqs", "1", "--n-predict", "5"])
    try:
        c = s.client(key=None)
        base = {"prompt": "Once", "temperature": 0, "ignore_eos": True}
        assert c.post("/completion", json=base).json()["tokens_predicted"] == 5
        assert c.post("/completion", json={**base, "n_predict": 9}).json()[
            "tokens_predicted"] == 9
    finally:
        stop_server(s.proc)
