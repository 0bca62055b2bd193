"""A speculating server: the same text as plain decoding, its drafts in every response's usage
and timings and in /metrics, per-request limits in muser's and llama-server's names, bad
settings refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.server.conftest import API_KEY, Server, start_server, stop_server

PASSAGE = ("The keeper climbed the stairs at dusk, lit the lamp, wound the clockwork that "
           "turned the lens, and wrote the hour, the wind and the ships he saw in the log. ")
PROMPT = PASSAGE * 3 + "Again: The keeper"


@pytest.fixture(scope="module")
def spec(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    s = start_server(gguf_path, tmp_path_factory.mktemp("spec"), [
        "--max-num-seqs", "4", "--max-model-len", "1024", "--api-key", API_KEY,
        "--speculative", "ngram", "--num-speculative-tokens", "4"])
    try:
        yield s
    finally:
        stop_server(s.proc)


def _complete(server: Server, **fields) -> dict:
    r = server.client().post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_outputs_are_plain_decodings_and_drafts_are_counted(spec: Server) -> None:
    off = _complete(spec, speculative=False)
    on = _complete(spec)
    capped = _complete(spec, speculative=1)
    assert on["choices"][0]["text"] == off["choices"][0]["text"] == capped["choices"][0]["text"]
    assert off["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    details = on["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert on["usage"]["completion_tokens"] == 40


def test_several_streams_speculate_beside_each_other(spec: Server) -> None:
    client = openai.OpenAI(base_url=spec.url + "/v1", api_key=API_KEY, max_retries=0)
    alone = _complete(spec, speculative=False)["choices"][0]["text"]
    before = spec.metric("muser_spec_decode_accepted_tokens_total")

    def stream(seed: int | None) -> str:
        sampling = {"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed}
        chunks = client.completions.create(model="x", prompt=PROMPT, max_tokens=40,
                                           stream=True, extra_body={"ignore_eos": True},
                                           **sampling)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(stream, [None, None, 3, 3]))
    assert texts[0] == texts[1] == alone and texts[2] == texts[3]
    assert spec.metric("muser_spec_decode_accepted_tokens_total") > before
    assert spec.metric("muser_spec_decode_draft_tokens_total") >= spec.metric(
        "muser_spec_decode_accepted_tokens_total")
    assert spec.metric("muser_spec_decode_accepted_tokens_per_position_total") == spec.metric(
        "muser_spec_decode_accepted_tokens_total")
    assert spec.metric("muser_spec_decode_verify_passes_total") > 0


def test_llama_completion_reports_draft_n(spec: Server) -> None:
    body = {"prompt": PROMPT, "n_predict": 32, "temperature": 0, "ignore_eos": True}
    on = spec.client().post("/completion", json=body).json()
    off = spec.client().post("/completion", json=body | {"speculative.n_max": 0}).json()
    assert on["content"] == off["content"]
    assert on["timings"]["draft_n"] >= on["timings"]["draft_n_accepted"] > 0
    assert "draft_n" not in off["timings"]  # NOTE: llama-server names drafts only where made
    # NOTE: a draft must be at least n_min long to be verified: none of 64
    never = spec.client().post("/completion", json=body | {"speculative.n_min": 64}).json()
    assert never["content"] == on["content"] and "draft_n" not in never["timings"]


@pytest.mark.parametrize("route, fields", [
    ("/v1/completions", {"speculative": -1}),
    ("/v1/completions", {"speculative": "yes"}),
    ("/v1/completions", {"speculative": 1.5}),
    ("/completion", {"speculative.n_max": -1}),
    ("/completion", {"speculative.p_min": 2}),
    ("/completion", {"speculative.n_maxx": 3}),
])
def test_bad_speculative_settings_are_400s(spec: Server, route: str, fields: dict) -> None:
    r = spec.client().post(route, json={"prompt": "Hi", "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert _complete(spec, max_tokens=2)["usage"]["completion_tokens"] == 2
