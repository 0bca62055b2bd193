"""The serving receipt's arithmetic (bench/serve_receipt.py): percentiles, per-request TPOT and
errors, the bound of a workload, and merging phases into one receipt."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# NOTE: bench/ holds scripts, not a package; the module is registered so dataclasses resolve it
_spec = importlib.util.spec_from_file_location(
    "serve_receipt", Path(__file__).resolve().parents[1] / "bench" / "serve_receipt.py")
sr = sys.modules.setdefault("serve_receipt", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(sr)


def test_percentiles_interpolate_between_order_statistics() -> None:
    values = [float(v) for v in range(1, 101)]  # 1 .. 100, shuffled order must not matter
    assert sr.pct(values[::-1], 50) == pytest.approx(50.5)
    assert sr.pct(values, 99) == pytest.approx(99.01)
    assert sr.pct(values, 100) == 100.0
    assert sr.pct([3.0], 99) == 3.0
    assert sr.pct([], 50) is None


def test_stream_tpot_counts_tokens_and_errors() -> None:
    s = sr.Stream(prompt_tokens=10, max_tokens=4, sent=1.0, stamps=[1.5, 1.6, 1.8, 2.1])
    assert s.ttft == pytest.approx(0.5)
    assert s.tpot == pytest.approx((2.1 - 1.5) / 3)
    assert s.ok
    assert not sr.Stream(10, 5, 1.0, [1.5, 1.6, 1.8, 2.1]).ok  # truncated
    assert not sr.Stream(10, 4, 1.0, list(s.stamps), error="APIError").ok
    # the final usage chunk counts the tokens when chunks carry more than one
    both = sr.Stream(10, 7, 1.0, [1.5, 2.1], usage=7)
    assert both.ok and both.tpot == pytest.approx(0.6 / 6)


def test_summarize_throughput_and_latency() -> None:
    streams = [sr.Stream(100, 3, 0.0, [1.0, 1.1, 1.2]), sr.Stream(100, 3, 0.0, [2.0, 2.2]),
               sr.Stream(100, 3, 0.0, [], error="boom")]
    cell = sr.summarize(streams, wall=4.0)
    assert cell["output_tok_s"] == pytest.approx(5 / 4)
    assert cell["total_tok_s"] == pytest.approx((200 + 5) / 4)  # started requests' prompts
    assert cell["errors"] == 2
    assert cell["ttft_p50_s"] == pytest.approx(1.5)
    assert cell["tpot_p50_ms"] == pytest.approx((100 + 200) / 2)


def test_w1_bound_is_two_waves_of_prefill_then_decode() -> None:
    """64 requests at concurrency 32, 512 in, 128 out: 2 x (32 x 512 / rate + 128 steps)."""
    w = sr.waves([512] * 64, [128] * 64, 32)
    assert w == [{"requests": 32, "prompt_tokens": 32 * 512, "output_tokens": 32 * 128}] * 2
    decode_ms = {1: 10.0, 8: 11.0, 32: 16.0, 64: 22.0}
    seconds = sr.bound_s(w, prefill_tok_s=8192.0, decode_ms=decode_ms)
    assert seconds == pytest.approx(2 * (32 * 512 / 8192 + 128 * 0.016))
    cell = {"model": "m", "workload": "W1", "chunk_policy": "adaptive", "requests": 64,
            "concurrency": 32, "decode_batch": 32, "waves": w, "output_tok_s": 1000.0}
    out = sr.with_bound(cell, {"prefill_tok_s": 8192.0,
                               "decode_step_ms": {str(b): v for b, v in decode_ms.items()}})
    assert out["decode_step_ms"] == 16.0
    assert out["bound_output_tok_s"] == pytest.approx(64 * 128 / seconds)
    assert out["fraction_of_bound"] == pytest.approx(1000.0 / (64 * 128 / seconds))


def test_uneven_waves_and_interpolated_steps() -> None:
    w = sr.waves([100, 200, 300], [10, 20, 30], 2)  # last wave holds one request
    assert w[1] == {"requests": 1, "prompt_tokens": 300, "output_tokens": 30}
    assert sr.step_ms_at({1: 10.0, 8: 24.0}, 4) == pytest.approx(16.0)
    assert sr.step_ms_at({1: 10.0, 8: 24.0}, 16) is None
    seconds = sr.bound_s(w, 100.0, {1: 10.0, 8: 24.0})
    assert seconds == pytest.approx(300 / 100 + 15 * 0.012 + 300 / 100 + 30 * 0.010)
    assert sr.bound_s(w, 100.0, {1: 10.0}) is None  # batch 2 was not measured


def test_merge_replaces_one_models_entries_and_recomputes_bounds() -> None:
    def cell(model: str, workload: str, tok_s: float) -> dict:
        return {"model": model, "workload": workload, "chunk_policy": "adaptive",
                "requests": 2, "concurrency": 2, "decode_batch": 2, "output_tok_s": tok_s,
                "waves": sr.waves([10, 10], [5, 5], 2)}

    old = sr.merge({}, {"cells": [cell("a", "W1", 1.0), cell("b", "W1", 2.0)],
                        "ceilings": {"b": {"prefill_tok_s": 20.0, "decode_step_ms": {"2": 100.0}}},
                        "machine": {"cpu": "x"}})
    assert old["cells"][0]["fraction_of_bound"] is None  # no ceilings for "a" yet
    assert old["cells"][1]["fraction_of_bound"] == pytest.approx(2.0 / (10 / 1.5))
    new = sr.merge(old, {"cells": [cell("a", "W1", 3.0)],
                         "ceilings": {"a": {"prefill_tok_s": 20.0, "decode_step_ms": {"2": 50.0}}}})
    assert [(c["model"], c["output_tok_s"]) for c in new["cells"]] == [("b", 2.0), ("a", 3.0)]
    assert set(new["ceilings"]) == {"a", "b"} and new["machine"] == {"cpu": "x"}
    assert new["cells"][1]["fraction_of_bound"] == pytest.approx(3.0 / (10 / 1.25))


def test_gap_summary_takes_the_gaps_overlapping_the_prefill() -> None:
    long = sr.Stream(2000, 1, sent=10.0, stamps=[12.0])
    streams = [sr.Stream(16, 100, 0.0, [9.0, 9.5, 10.5, 11.8, 12.1, 12.2])]
    out = sr.gap_summary(streams, long)
    assert out["long_prompt_ttft_s"] == pytest.approx(2.0)
    assert out["gaps_during_prefill"] == 3  # 9.5-10.5, 10.5-11.8, 11.8-12.1
    assert out["tpot_p50_ms"] == pytest.approx(1000.0)
    assert out["tpot_max_ms"] == pytest.approx(1300.0)
    assert out["errors"] == 0
    assert out["trace"]["prefill_s"] == pytest.approx(2.0)
    assert out["trace"]["stamps"][0][0] == pytest.approx(-1.0)


def test_merge_keeps_one_cell_per_variant() -> None:
    def cell(variant: str, tok_s: float | None) -> dict:
        out = {"model": "m", "workload": "W3", "chunk_policy": "adaptive", "variant": variant,
               "requests": 4, "concurrency": 2, "decode_batch": 2}
        return out | ({"output_tok_s": tok_s} if tok_s else {"server_error": "exit 2"})

    old = sr.merge({}, {"cells": [cell("off", 1.0), cell("on", 2.0), cell("fp8", None)]})
    new = sr.merge(old, {"cells": [cell("on", 3.0)]})
    assert [(c["variant"], c.get("output_tok_s")) for c in new["cells"]] == [
        ("off", 1.0), ("fp8", None), ("on", 3.0)]
    assert sr.cell_line(new["cells"][1]) == "m W3 (adaptive, fp8): exit 2"
