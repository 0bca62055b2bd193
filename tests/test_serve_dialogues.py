"""W3 chat and W4 agent (bench/serve_dialogues.py): their seeded shapes, the prefix-cache
counters read off /metrics, and the smallest of both run by bench/serve_bench.py against a real
`muser serve` of the embedded model on loopback."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    # NOTE: bench/ holds scripts, not a package; each module is registered under the name the
    # others import it by (serve_dialogues imports serve_receipt)
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


_load("serve_receipt")
sd = _load("serve_dialogues")


def test_a_dialogue_is_seeded() -> None:
    d = sd.Dialogue("W3", conversations=3, turns=4, shared_tokens=20, turn_tokens=5,
                    output_tokens=2, concurrency=2, gap_s=0.5, seed=7)
    assert len(d.shared()) == 20 and d.shared() == d.shared()
    new = d.new_ids()
    assert [len(turns) for turns in new] == [4] * 3
    assert {len(ids) for turns in new for ids in turns} == {5}
    assert len({tuple(ids) for turns in new for ids in turns}) == 12  # every turn its own ids
    gaps = d.gaps()
    assert gaps == d.gaps() and [len(g) for g in gaps] == [3] * 3  # none before turn 1
    assert all(g > 0 for row in gaps for g in row)
    assert sd.Dialogue("W4", 2, 3, 8, 4, 2, 2, 0.0, 1).gaps() == [[0.0, 0.0]] * 2


def test_prefix_fields_are_the_counters_deltas() -> None:
    def page(lookups: float, device: float, host: float, reused: float) -> str:
        return (f"# HELP muser_prefix_cache_lookups_total Prompts\n"
                f"muser_prefix_cache_lookups_total {lookups}\n"
                f'muser_prefix_cache_hits_total{{tier="device"}} {device}\n'
                f'muser_prefix_cache_hits_total{{tier="host"}} {host}\n'
                f"muser_prefix_cache_tokens_reused_total {reused}\n"
                f'muser_prefix_cache_host_copied_bytes_total{{direction="to_device"}} {host * 8}\n'
                f"muser_prefix_cache_pages 3.0\n")

    out = sd.prefix_fields(page(2, 1, 0, 50), page(12, 7, 2, 950))
    assert out["lookups"] == 10 and out["hits"] == {"device": 6, "host": 2}
    assert out["hit_rate"] == {"device": 0.6, "host": 0.2}
    assert out["tokens_reused"] == 900 and out["host_copied_bytes"] == {"to_device": 16}
    assert sd.prefix_fields("muser_steps_total 4.0\n", "muser_steps_total 9.0\n") is None


def test_w3_and_w4_over_http(gguf_path: Path, tmp_path: Path) -> None:
    """The smallest W3 (4 conversations x 2 turns) and W4 (2 agents x 3 steps) on one server
    with reuse on, and a variant whose flag the server refuses: its cells say so, the run goes
    on. Every turn completes, the answers' ids are resent (turns from 2 on start after a cached
    prefix), and the server's two counts of cached tokens agree."""
    out = tmp_path / "receipt.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "serve_bench.py"), "--model", str(gguf_path),
         "--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "4",
         "--phases", "w3,w4", "--variants", "on,refused=--prefix-cache --no-such-flag",
         "--w3-conversations", "4", "--w3-turns", "2", "--w3-system", "48", "--w3-user", "16",
         "--w3-output", "4", "--w3-concurrency", "2", "--w3-gap-s", "0.05",
         "--w4-agents", "2", "--w4-steps", "3", "--w4-preamble", "64", "--w4-input", "12",
         "--w4-output", "3", "--w4-concurrency", "2", "--w4-gap-s", "0.05",
         "--timeout", "240", "--start-timeout", "300", "--logs", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = {(c["workload"], c["variant"]): c for c in json.loads(out.read_text())["cells"]}
    assert set(cells) == {("W3", "on"), ("W4", "on"), ("W3", "refused"), ("W4", "refused")}
    for name, output in (("W3", 4), ("W4", 3)):
        c = cells[name, "on"]
        turns = c["conversations"] * c["turns"]
        assert c["turns_completed"] == turns == c["requests"] and c["errors"] == 0
        assert c["output_tokens"] == turns * output and c["output_tokens_per_turn"] == output
        assert c["variant_flags"] == ["--prefix-cache"]
        assert len(c["ttft_p50_by_turn_s"]) == c["turns"]
        for field in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "ttft_p50_from_turn2_s",
                      "tpot_p99_ms", "wall_s"):
            assert c[field] > 0, field
        prefix = c["prefix"]
        assert prefix["lookups"] == turns  # one per prompt, the warm-up's not counted
        assert c["turns_hit_from_turn2"] == 1.0  # each resent its history
        assert prefix["hits"]["device"] >= turns - c["conversations"]
        assert prefix["hit_rate"]["device"] > 0 and prefix["hits"]["host"] == 0
        assert prefix["tokens_reused"] == c["cached_tokens"] > 0
        refused = cells[name, "refused"]
        assert "unrecognized arguments: --no-such-flag" in refused["server_error"]
        assert "output_tok_s" not in refused and refused["turns"] == c["turns"]
