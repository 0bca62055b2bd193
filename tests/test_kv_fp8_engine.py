"""An FP8 KV cache through the engine on the embedded 270M: the pool's packed rows hold what a
prefix hit, a snapshot and its checksums carry, and greedy decoding stays close to a float32
cache's. The CPU's kernels refuse FP8 (EngineConfig), so this runs the torch reference ops
(MUSER_OPS=ref), which read the same rows as the GPU's kernels (tests/ops/test_kv_fp8.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from muser import LLM
from muser.errors import MuserError
from muser.kvcache import snapshot
from tests.prefix_runs import run_and_decode

PROMPT = "The tide came in over the stones, and the keeper wrote it down. " * 6


@pytest.fixture(scope="module")
def reference_ops() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MUSER_OPS", "ref")
        yield


def _llm(gguf_path: Path, kv: str) -> LLM:
    return LLM(gguf_path, progress=False, device="cpu", kv_cache_dtype=kv, max_num_seqs=2,
               max_model_len=1024, page_size=64)


@pytest.fixture(scope="module")
def fp8(gguf_path: Path, reference_ops) -> LLM:
    return _llm(gguf_path, "fp8")


@pytest.fixture(scope="module")
def f32(gguf_path: Path, reference_ops) -> LLM:
    return _llm(gguf_path, "float32")


def test_the_pool_holds_packed_rows(fp8: LLM) -> None:
    cfg, pool = fp8.model_config, fp8.runner.pool
    assert pool.dtype == torch.uint8 and fp8.config.kv_dtype == "fp8"
    assert pool.pages.shape[-2:] == (cfg.num_kv_heads, cfg.head_dim + 4)
    assert pool.page_nbytes == 2 * len(cfg.layers_of("global")) * 64 * cfg.num_kv_heads * (
        cfg.head_dim + 4)


def test_greedy_close_to_a_float32_cache(fp8: LLM, f32: LLM) -> None:
    ids = fp8.encode(PROMPT)
    _, fp8_rows, fp8_tokens = run_and_decode(fp8.runner, ids, 16)
    _, f32_rows, f32_tokens = run_and_decode(f32.runner, ids, 16)
    agree = sum(a == b for a, b in zip(fp8_tokens, f32_tokens, strict=True))
    # NOTE: the prompt's rows, where both attend the same prompt: e4m3's 2^-4 per value
    assert float((fp8_rows[:len(ids)] - f32_rows[:len(ids)]).abs().max()) < 2.0
    assert agree >= 14, (fp8_tokens, f32_tokens)


def test_a_prefix_hit_reads_the_rows_it_stored(fp8: LLM) -> None:
    """A second turn reuses the first's FP8 pages and ring checkpoint (bytes copied with their
    scales) and decodes the tokens of a cold prefill of the same prompt."""
    runner = fp8.runner
    runner.prefix.reset(runner.pages)
    ids = fp8.encode(PROMPT)
    _, _, first = run_and_decode(runner, ids, 4)
    follow = ids + first + fp8.encode(" Then the lighthouse went dark.")[1:]
    reused, hit, hit_tokens = run_and_decode(runner, follow, 6)
    assert reused == len(ids) + len(first) - 1
    runner.prefix.reset(runner.pages)
    cold_reused, cold, cold_tokens = run_and_decode(runner, follow, 6)
    assert cold_reused == 0 and hit_tokens == cold_tokens
    # NOTE: the reference ops give no bits across widths (docs/exactness.md): an ulp upstream
    # may move a key across an e4m3 rounding boundary, a step of 2^-4 of it (the GPU's exact
    # route gives the hit the cold prefill's bits, tests/ops/test_layer_graph.py)
    assert float((hit - cold[reused:]).abs().max()) < 2.0**-4 * float(cold.abs().max())


def test_a_snapshot_carries_the_rows_and_refuses_to_convert(fp8: LLM, f32: LLM) -> None:
    runner = fp8.runner
    ids = fp8.encode(PROMPT)
    seq = runner.allocate()
    logits = runner.forward([seq], [ids])
    snap = snapshot.export(runner, seq, logits[-1])
    assert snap.full.dtype == torch.uint8
    sums = snapshot.layer_checksums(snap.full)
    runner.free(seq)
    twin = snapshot.install(runner, snap, ids)
    again = snapshot.export(runner, twin, logits[-1])
    assert torch.equal(again.full, snap.full) and torch.equal(again.sliding, snap.sliding)
    assert snapshot.layer_checksums(again.full) == sums
    runner.free(twin)
    with pytest.raises(MuserError, match="FP8 and other KV dtypes do not convert"):
        snapshot.install(f32.runner, snap, ids)
