"""llama.cpp routes over plain HTTP."""

from __future__ import annotations

import json

from tests.server.conftest import MAX_MODEL_LEN, MAX_NUM_SEQS, Server


def test_health_needs_no_key(server: Server) -> None:
    r = server.client(key=None).get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_whole_and_streamed_agree(server: Server) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 5, "temperature": 0}
    whole = server.client().post("/completion", json=body).json()
    assert whole["stop"] is True and whole["tokens_predicted"] == 5
    assert whole["stop_type"] == "limit" and whole["timings"]["predicted_n"] == 5
    events = []
    with server.client().stream("POST", "/completion", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    # llama-server's framing: every token in a stop: false chunk, then an empty stop: true one
    assert [e["stop"] for e in events] == [False] * 5 + [True]
    assert all(len(e["tokens"]) == 1 for e in events[:-1]) and events[-1]["content"] == ""
    assert events[-1]["tokens_predicted"] == 5 and events[-1]["stop_type"] == "limit"


def test_tokenize_detokenize_round_trip(server: Server) -> None:
    c = server.client()
    text = "Hello, wörld! 你好"
    ids = c.post("/tokenize", json={"content": text}).json()["tokens"]
    with_bos = c.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert len(with_bos) == len(ids) + 1
    assert c.post("/detokenize", json={"tokens": ids}).json()["content"] == text
    pieces = c.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids


def test_props(server: Server) -> None:
    props = server.client().get("/props").json()
    assert props["total_slots"] == MAX_NUM_SEQS
    assert props["batching"] == {"max_num_seqs": MAX_NUM_SEQS, "max_batched_tokens": 512,
                                 "decode_waiting_chunk": 64, "prefill_chunk": 512}
    assert props["default_generation_settings"]["n_ctx"] == MAX_MODEL_LEN


def test_slots_lists_every_slot_idle(server: Server) -> None:
    slots = server.admin().get("/slots").json()
    assert [s["id"] for s in slots] == list(range(MAX_NUM_SEQS))
    assert not any(s["is_processing"] for s in slots)
