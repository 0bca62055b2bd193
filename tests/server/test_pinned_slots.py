"""llama-server's slot pinning (id_slot) and its per-request extras over HTTP: a request runs
in the slot it names (waiting while another holds it), finds that slot's cache, and slot save /
restore / erase act on it; post_sampling_probs, timings_per_token, return_progress; --alias and
--tags."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, start_server, stop_server

NUM_SLOTS, CHUNK = 3, 64


@pytest.fixture(scope="module")
def pin_server(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("pins")
    s = start_server(gguf_path, tmp, [
        "--max-num-seqs", str(NUM_SLOTS), "--max-model-len", "512", "--max-batched-tokens",
        str(CHUNK), "--keyless-admin", "--slot-save-path", str(tmp / "files"),
        "--alias", "tinyllama-2,fim,code", "--tags", "chat,fim,small"])
    try:
        yield s
    finally:
        stop_server(s.proc)


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _slots(s: Server) -> dict[int, dict]:
    return {slot["id"]: slot for slot in s.client(None).get("/slots").json()}


def _ids(s: Server, text: str, special: bool = True) -> list[int]:
    return s.client(None).post("/tokenize", json={"content": text, "add_special": special}
                               ).json()["tokens"]


def test_a_pinned_request_waits_for_its_slot(pin_server: Server) -> None:
    """While a stream runs in slot 2, a request pinned to slot 2 waits (shown in /slots) and
    ends after it; the slot answers in id_slot."""
    c = pin_server.client(None)
    body = {"prompt": "The river", "temperature": 0, "ignore_eos": True, "id_slot": 2}
    done: dict[str, float] = {}
    with c.stream("POST", "/completion", json={**body, "n_predict": 40, "stream": True}) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert first["id_slot"] == 2 and _slots(pin_server)[2]["is_processing"]
        result: list[dict] = []

        def pinned() -> None:
            result.append(pin_server.client(None).post(
                "/completion", json={**body, "n_predict": 2}).json())
            done["pinned"] = time.monotonic()

        t = threading.Thread(target=pinned)
        t.start()
        deadline = time.monotonic() + 30
        while _slots(pin_server)[2]["n_waiting"] != 1:
            assert time.monotonic() < deadline, _slots(pin_server)
            time.sleep(0.05)
        for _ in lines:
            pass
        done["stream"] = time.monotonic()
    t.join(60)
    assert result[0]["id_slot"] == 2 and result[0]["tokens_predicted"] == 2
    assert done["pinned"] > done["stream"]
    assert _slots(pin_server)[2]["n_waiting"] == 0


def test_a_pinned_slot_keeps_its_cache_and_its_actions_act_on_it(pin_server: Server) -> None:
    """A follow-up pinned to the same slot starts after what the slot's last request left;
    save / erase / restore act on the named slot (/slots shows each one's cache)."""
    c, admin = pin_server.client(None), pin_server.client(None)
    body = {"n_predict": 4, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    prompt = _ids(pin_server, "The lighthouse keeper counted the ships. " * 6)
    first = c.post("/completion", json={**body, "prompt": prompt, "id_slot": 1}).json()
    ids = prompt + first["tokens"][:-1]  # NOTE: the last token was never fed back
    assert _slots(pin_server)[1]["n_cached"] == len(ids)
    follow = {**body, "prompt": ids + _ids(pin_server, " Then night fell.", False)}
    warm = c.post("/completion", json={**follow, "id_slot": 1}).json()
    assert warm["timings"]["cache_n"] == len(ids)

    assert admin.post("/slots/1?action=save", json={"filename": "one.bin"}).json()[
        "n_saved"] == len(follow["prompt"]) + 3
    erased = admin.post("/slots/1?action=erase").json()
    assert erased == {"id_slot": 1, "n_erased": len(follow["prompt"]) + 3}
    assert _slots(pin_server)[1]["n_cached"] == 0
    cold = c.post("/completion", json={**follow, "id_slot": 1}).json()
    assert cold["timings"]["cache_n"] == 0 and cold["tokens"] == warm["tokens"]
    restored = admin.post("/slots/0?action=restore", json={"filename": "one.bin"}).json()
    assert restored["id_slot"] == 0 and _slots(pin_server)[0]["n_cached"] == restored[
        "n_restored"] == len(follow["prompt"]) + 3
    saved = follow["prompt"] + warm["tokens"][:-1]
    again = c.post("/completion", json={**body, "id_slot": 0, "prompt": saved + _ids(
        pin_server, " The end.", False)}).json()
    assert again["timings"]["cache_n"] == len(saved)


@pytest.mark.parametrize("path", ["/completion", "/chat/completions", "/v1/chat/completions"])
def test_a_slot_out_of_range_is_a_400_naming_the_range(pin_server: Server, path: str) -> None:
    body = ({"prompt": "Hi"} if path == "/completion" else
            {"messages": [{"role": "user", "content": "Hi"}]}) | {"id_slot": NUM_SLOTS}
    r = pin_server.client(None).post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "id_slot" and f"0 to {NUM_SLOTS - 1}" in error["message"]


def test_samples_of_a_pinned_request_take_other_slots(pin_server: Server) -> None:
    """n samples with id_slot (llama-server's test_chat_completions_multiple_choices): the
    request runs in its slot, the samples in free ones; twice, so the second finds the first's
    cache; n = every slot also runs."""
    c = pin_server.client(None)
    for n in (2, 2, NUM_SLOTS):
        r = c.post("/chat/completions", json={
            "max_tokens": 8, "n": n, "id_slot": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": "Book"},
                         {"role": "user", "content": "What is the best book"}]})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == n and {ch["finish_reason"] for ch in choices} == {"length"}


def test_n_cmpl_samples_each_prompt_as_llama_server_does(pin_server: Server) -> None:
    """/completion's n_cmpl (alias n): results p * n_cmpl + i, prompt p's sample i, drawn from
    seed + i as llama-server's child tasks are; with id_slot the first runs in its slot; a
    stream's chunks carry their sample's index, each sample's stop chunk as it finishes; more
    samples than slots is a 400 naming n_cmpl."""
    c = pin_server.client(None)
    body = {"n_predict": 6, "temperature": 1.0, "seed": 5, "ignore_eos": True,
            "return_tokens": True}
    prompts = ["Once upon a time", "The capital of France is"]
    r = c.post("/completion", json={**body, "prompt": prompts, "n_cmpl": 2, "id_slot": 1})
    assert r.status_code == 200, r.text
    results = r.json()
    assert [x["index"] for x in results] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for i in range(2):
            alone = c.post("/completion", json={**body, "prompt": prompt, "seed": 5 + i}).json()
            assert results[p * 2 + i]["tokens"] == alone["tokens"], (p, i)
            assert results[p * 2 + i]["tokens_predicted"] == 6
    by_n = c.post("/completion", json={**body, "prompt": prompts[0], "n": 2}).json()
    assert [x["tokens"] for x in by_n] == [x["tokens"] for x in results[:2]]
    with c.stream("POST", "/completion", json={**body, "prompt": prompts[0], "n_cmpl": 2,
                                               "stream": True}) as s:
        chunks = _events(s)
    for i in range(2):
        mine = [ch for ch in chunks if ch["index"] == i]
        assert [t for ch in mine for t in ch["tokens"]] == results[i]["tokens"]
        assert [ch["stop"] for ch in mine] == [False] * 6 + [True]
    too_many = c.post("/completion", json={**body, "prompt": "x", "n_cmpl": NUM_SLOTS + 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n_cmpl"


def test_post_sampling_probs(pin_server: Server) -> None:
    """The probabilities of the distribution each token is drawn from: at top_k 5 they are the
    softmax of the 5 pre-sampling logprobs; the same tokens as without the field; greedy: the
    chosen token at probability 1."""
    c = pin_server.client(None)
    body = {"prompt": "Today I would finally become a", "n_probs": 5, "n_predict": 5,
            "temperature": 1.0, "top_k": 5, "min_p": 0.0, "top_p": 1.0, "seed": 7}
    pre = c.post("/completion", json=body).json()["completion_probabilities"]
    r = c.post("/completion", json={**body, "post_sampling_probs": True})
    assert r.status_code == 200, r.text
    post = r.json()["completion_probabilities"]
    assert [t["id"] for t in post] == [t["id"] for t in pre]
    for a, b in zip(pre, post):
        assert set(b) == {"id", "token", "prob", "bytes", "top_probs"}
        total = sum(math.exp(t["logprob"]) for t in a["top_logprobs"])
        assert [t["id"] for t in b["top_probs"]] == [t["id"] for t in a["top_logprobs"]]
        for x, y in zip(a["top_logprobs"], b["top_probs"]):
            assert y["prob"] == pytest.approx(math.exp(x["logprob"]) / total, rel=1e-4)
        assert b["prob"] == next(t["prob"] for t in b["top_probs"] if t["id"] == b["id"])
    greedy = c.post("/completion", json={**body, "temperature": 0,
                                         "post_sampling_probs": True}).json()
    for t in greedy["completion_probabilities"]:
        assert t["prob"] == 1.0 and [p["id"] for p in t["top_probs"]] == [t["id"]]
    r = c.post("/completion", json={"prompt": "x", "post_sampling_probs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "post_sampling_probs"


def test_prompt_progress_and_timings_per_token(pin_server: Server) -> None:
    """return_progress: a report when the prompt is placed (processed == cache), then one per
    step that computes its rows (CHUNK rows a step here) up to processed == total, before the
    first token; timings_per_token: every chunk carries the timings so far."""
    c = pin_server.client(None)
    prompt = "the quick brown fox jumps over the lazy dog " * 20
    with c.stream("POST", "/completion", json={
            "prompt": prompt, "n_predict": 3, "stream": True, "timings_per_token": True,
            "return_progress": True, "ignore_eos": True, "temperature": 0}) as r:
        chunks = _events(r)
    progress = [ch for ch in chunks if "prompt_progress" in ch]
    reports = [ch["prompt_progress"] for ch in progress]
    total, cache = reports[0]["total"], reports[0]["cache"]
    assert reports[0]["processed"] == cache and progress[0]["timings"]["prompt_n"] == 0
    assert progress[0]["timings"]["prompt_ms"] == 0.0
    assert [p["processed"] for p in reports[1:]] == [
        min(cache + CHUNK * i, total) for i in range(1, 1 + math.ceil((total - cache) / CHUNK))]
    assert all(p["total"] == total and p["cache"] == cache for p in reports)
    ms = [ch["timings"]["prompt_ms"] for ch in progress]
    assert ms == sorted(ms) and ms[-1] > 0
    assert chunks.index(progress[-1]) < next(i for i, ch in enumerate(chunks) if ch["tokens"])
    tokens = [ch for ch in chunks if ch["tokens"]]
    assert [ch["timings"]["predicted_n"] for ch in tokens] == [1, 2, 3]

    with c.stream("POST", "/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}, "timings_per_token": True,
            "return_progress": True, "ignore_eos": True}) as r:
        chat = _events(r)
    assert "timings" not in chat[0] and chat[0]["choices"][0]["delta"]["role"] == "assistant"
    reports = [ch["prompt_progress"] for ch in chat if "prompt_progress" in ch]
    assert len(reports) >= 2 and reports[-1]["processed"] == reports[-1]["total"]
    assert all("timings" in ch for ch in chat[1:]) and chat[-1]["timings"]["predicted_n"] == 3
    r = c.post("/completion", json={"prompt": "x", "return_progress": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_progress"


def test_aliases_and_tags(pin_server: Server) -> None:
    """--alias: every name listed, the id the first in alphabetical order (llama-server's);
    --tags listed beside them."""
    c = pin_server.client(None)
    (model,) = c.get("/models").json()["data"]
    assert model["id"] == "code" and set(model["aliases"]) == {"tinyllama-2", "fim", "code"}
    assert model["tags"] == ["chat", "fim", "small"]
    props = c.get("/props").json()
    assert props["model_alias"] == "code" and props["model_tags"] == ["chat", "fim", "small"]
    assert c.post("/completion", json={"prompt": "x", "n_predict": 1}).json()["model"] == "code"
