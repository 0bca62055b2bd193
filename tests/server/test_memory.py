"""Memory by category over HTTP: /props's `memory` object and /metrics' gauges agree, and the
KV page counts follow a request in flight."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from muser.memory import CATEGORIES
from tests.server.conftest import MAX_MODEL_LEN, MAX_NUM_SEQS, Server


def _gauges(server: Server) -> dict[str, dict]:
    text = server.client().get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {"memory": {s.labels["category"]: s.value
                       for s in families["muser_memory_bytes"].samples},
            "pages": families["muser_kv_pages"].samples[0].value,
            "free": families["muser_free_kv_pages"].samples[0].value}


def test_props_reports_memory_by_category(server: Server) -> None:
    memory = server.client().get("/props").json()["memory"]
    held = memory["bytes"]
    assert tuple(held) == CATEGORIES and memory["total_bytes"] == sum(held.values())
    assert held["weights"] > 100 << 20  # the 270M model's codes
    assert held["kv_sliding"] > 0 and held["kv_pages"] > 0 and held["workspace"] > 0
    assert held["prefix_cache"] > 0 and memory["workspace_basis"] == "estimated"
    pages = memory["kv_pages"]
    per_seq = -(-MAX_MODEL_LEN // pages["page_size"])
    assert pages["total"] == MAX_NUM_SEQS * per_seq  # the CPU's sizing
    assert 0 <= pages["free"] <= pages["total"]


def test_metrics_match_props(server: Server) -> None:
    props = server.client().get("/props").json()["memory"]
    gauges = _gauges(server)
    assert gauges["memory"] == {k: float(v) for k, v in props["bytes"].items()}
    assert gauges["pages"] == props["kv_pages"]["total"]


def _free_pages(server: Server) -> int:
    return server.client().get("/props").json()["memory"]["kv_pages"]["free"]


def _until_all_free(server: Server, total: float) -> None:
    deadline = time.monotonic() + 30
    while _free_pages(server) != total and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _free_pages(server) == total


def test_free_pages_follow_a_request_in_flight(server: Server) -> None:
    total = _gauges(server)["pages"]
    _until_all_free(server, total)  # whatever earlier tests left in flight has ended
    body = {"prompt": "Once upon a time", "n_predict": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with server.client().stream("POST", "/completion", json=body) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        next(events), next(events)  # NOTE: the loop's snapshot after the first step is out
        during = _free_pages(server)
        assert during < total and _gauges(server)["free"] == during
    _until_all_free(server, total)  # the client went away: the request's pages came back
