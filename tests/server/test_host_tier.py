"""The prefix cache's host tier over HTTP: a server whose device holds one sequence's two pages
and one checkpoint moves a first prompt's KV to the host when another prompt needs the room,
and the first prompt continued copies it back; /metrics counts the hit on the host tier, the
bytes moved each way and the seconds they took."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Server, start_server, stop_server


@pytest.fixture(scope="module")
def tiered(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("host_tier")
    # NOTE: 512 tokens of one sequence: 2 pages of 256 rows; 0.02 GB: one checkpoint (16 MB)
    s = start_server(gguf_path, tmp, ["--max-num-seqs", "1", "--max-model-len", "512",
                                      "--prefix-cache-gb", "0.02", "--kv-host-gb", "0.1"])
    try:
        yield s
    finally:
        stop_server(s.proc)


def _samples(server: Server) -> dict[tuple[str, tuple], float]:
    text = server.client().get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _complete(server: Server, ids: list[int], max_tokens: int) -> dict:
    r = server.client().post("/v1/completions", json={"prompt": ids, "max_tokens": max_tokens,
                                                      "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_a_prompt_evicted_to_the_host_comes_back_and_is_counted(tiered: Server) -> None:
    first = [2] + [1000 + (i * 7919) % 50_000 for i in range(299)]
    other = [2] + [3000 + (i * 104_729) % 50_000 for i in range(299)]
    _complete(tiered, first, 1)  # ends with its 300 rows cached: a page and a checkpoint
    _complete(tiered, other, 1)  # takes both pages and the checkpoint: the first's go to host
    before = _samples(tiered)
    assert before[("muser_prefix_cache_host_checkpoints", ())] >= 1
    again = _complete(tiered, first + [1017, 563, 2048], 2)
    assert again["prompt_tokens_details"]["cached_tokens"] == 300
    after = _samples(tiered)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("muser_prefix_cache_hits_total", tier="host") == 1
    assert grew("muser_prefix_cache_hits_total", tier="device") == 0
    # NOTE: back, in float32 (one KV head of 256): the first page (K and V of 256 rows in 3
    # full layers) and the checkpoint (a 512-row ring in 15 sliding layers, its partial page)
    page, rings = 2 * 3 * 256 * 256 * 4, 2 * 15 * 512 * 256 * 4
    assert grew("muser_prefix_cache_host_copied_bytes_total", direction="to_device") == (
        2 * page + rings)
    assert after[("muser_prefix_cache_host_copied_bytes_total", (("direction", "to_host"),))] > 0
    assert grew("muser_prefix_cache_host_copy_seconds_total", direction="to_device") > 0
    assert after[("muser_prefix_cache_host_bytes", ())] <= after[
        ("muser_prefix_cache_host_capacity_bytes", ())] == int(0.1 * 2**30)
    evicted = (("kind", "page"), ("tier", "device"))
    assert after[("muser_prefix_cache_evictions_total", evicted)] >= 1
