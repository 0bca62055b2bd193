"""--context-shift over HTTP on a tiny context: a generation runs past the context, each shift
dropping the oldest half after n_keep (llama-server's rule, simulated here), and after every
shift its next tokens are, token for token, what a new request whose prompt is the shortened
context generates (the kept rows' KV is computed again as a prefill: muser/engine/shift.py).
Without the flag the context ends generation ("length"; tests/server/test_llama_compat.py)
and n_keep / n_discard are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.conftest import Server, start_server, stop_server

CTX = 64
PROMPT = "Once upon a time, in a small village by the sea, there lived"
GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}


@pytest.fixture(scope="module")
def shifting(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    s = start_server(gguf_path, tmp_path_factory.mktemp("shift"),
                     ["--context-shift", "--max-model-len", str(CTX), "--max-num-seqs", "2"])
    try:
        yield s
    finally:
        stop_server(s.proc)


def shifts(prompt: list[int], outputs: list[int], n_keep: int) -> list[tuple[int, list[int]]]:
    """llama-server's rule replayed -> (outputs before each shift, the context ids after it)."""
    ids, context, out = prompt + outputs, list(range(len(prompt))), []
    for j in range(len(outputs) - 1):  # NOTE: the last token ends the request first
        context.append(len(prompt) + j)
        cached = len(context) - 1
        if cached + 1 < CTX:
            continue
        keep = min((len(prompt) if n_keep < 0 else n_keep) + 1, CTX - 4)  # BOS kept too
        rest = cached - keep
        context = context[:keep] + context[keep + max(0, min(rest // 2, rest - 1)):]
        out.append((j + 1, [ids[i] for i in context]))
    return out


@pytest.mark.parametrize("n_keep", [0, 5, -1])
def test_generation_goes_on_past_the_context(shifting: Server, n_keep: int) -> None:
    c = shifting.client(None)
    prompt = c.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    r = c.post("/completion", json={"prompt": PROMPT, "n_predict": 3 * CTX, "n_keep": n_keep,
                                    **GREEDY}).json()
    assert r["tokens_predicted"] == 3 * CTX and r["truncated"] is True
    assert r["timings"]["prompt_n"] == len(prompt) and r["stop_type"] == "limit"
    points = shifts(prompt, r["tokens"], n_keep)
    assert len(points) >= 3
    for done, context in points[:2]:
        fresh = c.post("/completion", json={"prompt": context, "n_predict": 8, **GREEDY}).json()
        assert fresh["tokens"] == r["tokens"][done:done + 8], (n_keep, done)


def test_n_predict_is_not_capped_at_the_context(shifting: Server) -> None:
    c = shifting.client(None)
    r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2 * CTX,
                                        "temperature": 0, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 2 * CTX
    assert r["choices"][0]["finish_reason"] == "length"


def test_n_keep_needs_the_flag(server: Server) -> None:
    for field, value in (("n_keep", 4), ("n_discard", 8)):
        res = server.client().post("/completion", json={"prompt": "Hi", "n_predict": 1,
                                                        field: value})
        assert res.status_code == 400 and res.json()["error"]["param"] == field
        assert "--context-shift" in res.json()["error"]["message"]
    for value in (-1, 0):  # what a server that never shifts does anyway
        res = server.client().post("/completion", json={"prompt": "Hi", "n_predict": 1,
                                                        "n_keep": value})
        assert res.status_code == 200
