"""The full layer graph on a tiny random model (window 16): every chunking is bitwise the same,
prompts many windows long work, and sliding-layer KV memory does not grow with the context."""

from __future__ import annotations

import pytest
import torch

from muser.config import EngineConfig, ModelConfig, gemma3_layer_kinds
from muser.graph.weights import random_weights
from muser.runner import Runner
from tests.graph.exactness import capture, capture_one_chunk, first_difference

W = 16
CFG = ModelConfig(
    architecture="gemma3", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=6,
    num_heads=4, num_kv_heads=2, head_dim=16, layer_kinds=gemma3_layer_kinds(6, 3),
    sliding_window=W, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=16,
)


def _runner(max_model_len: int = 512, tile: int = 8, dtype: str = "float32") -> Runner:
    engine = EngineConfig.for_device(device="cpu", dtype=dtype, kv_dtype="float32", max_num_seqs=2,
                                     max_model_len=max_model_len, page_size=8)
    runner = Runner(CFG, engine, random_weights(CFG, getattr(torch, dtype), "cpu", seed=0))
    runner.tile = tile  # small tiles so every route appears at this size
    return runner


def _ids(n: int) -> list[int]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [1, 5, 13, 16])
def test_chunk_widths_agree_through_ring_wraps(chunk: int, dtype: str) -> None:
    """bfloat16 weights too: the same kernels over bfloat16 values (widened exactly)."""
    runner, ids = _runner(dtype=dtype), _ids(5 * W + 3)
    positions = {1, W - 1, W, W + 1, 2 * W - 1, 2 * W, 2 * W + 1, 3 * W, 4 * W + 1, 5 * W + 2}
    one = capture_one_chunk(runner, ids, positions)  # chunks up to 5 windows long
    other = capture(runner, ids, chunk, positions)
    assert first_difference(one[0], other[0]) is None
    assert first_difference(one[1], other[1]) is None


def test_sliding_kv_memory_is_o_window() -> None:
    short, long = _runner(max_model_len=64), _runner(max_model_len=4096)
    assert short.pool.rings.shape == long.pool.rings.shape
    assert short.pool.rings.shape[3] == W  # ring capacity: one window per sequence slot
    assert long.pool.pages.nbytes > short.pool.pages.nbytes  # only full layers grow
    seq = long.allocate()
    logits = long.forward([seq], [_ids(40 * W)])  # 40 windows in one prompt
    assert torch.isfinite(logits).all() and seq.ring.length == W
    assert seq.ring.logical_end == 40 * W
