"""DESIGN section 7 for Gemma 4 on the CPU, bitwise (as tests/graph/test_exactness.py for
Gemma 3): on each tiny checkpoint of tests/gemma4/checkpoints.py, a prompt five windows long
gives the same logits and K/V rows prefilled in one chunk, in chunks of several widths (some
that do not divide the window, so chunks over wrapped rings take the staging shadow), token by token, and
inside steps shared with other sequences of other lengths. A KV-sharing layer reads its owner's
rows, the only copy."""

from __future__ import annotations

import pytest
import torch

from muser.loading import load_model
from tests.gemma4.checkpoints import VARIANTS, W, write_checkpoint
from tests.gemma4.test_parity import prompt, runner_of
from tests.graph.exactness import capture, capture_in_batch, capture_one_chunk, first_difference

LENGTH = 5 * W
WIDTHS = [1, 3, 5, 7, 8]  # at most W: capture reads each row back before the ring drops it
POSITIONS = {1, W - 1, W, W + 1, 2 * W - 1, 2 * W, 2 * W + 1, 3 * W + 2, 4 * W, LENGTH - 1}
POSITIONS |= {e + d for w in WIDTHS[1:] for e in range(w, LENGTH, w) for d in (-1, 0)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def runs(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    directory = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    runner = runner_of(load_model(directory, torch.float32, "cpu", progress=False), 8)
    ids = prompt(LENGTH, 5)
    results = {"one": capture_one_chunk(runner, ids, POSITIONS)}
    for width in WIDTHS:
        results[f"c{width}"] = capture(runner, ids, width, POSITIONS)
    others = [prompt(n, 20 + n)[::-1] for n in (3, 11, 30, 45)]
    results["batch"] = capture_in_batch(runner, ids, 5, POSITIONS, others, [1, 1, 4, 9])
    return request.param, results


@pytest.mark.parametrize("name", [f"c{w}" for w in WIDTHS] + ["batch"])
def test_every_chunking_is_bitwise_the_one_chunk_prefill(runs, name: str) -> None:
    variant, results = runs
    one, other = results["one"], results[name]
    assert first_difference(one[0], other[0]) is None, f"{variant} logits"
    assert first_difference(one[1], other[1]) is None, f"{variant} K/V rows"


def test_kv_sharing_layers_hold_no_cache_of_their_own(tmp_path) -> None:
    model = load_model(write_checkpoint("ple_shared", tmp_path), torch.float32, "cpu", False)
    cfg, runner = model.config, runner_of(model)
    assert [cfg.kv_owner(i) for i in range(8)] == [0, 1, 2, 3, 4, 2, 4, 2]
    pool = runner.pool
    assert pool.rings.shape[0] == 4 and pool.pages.shape[0] == 1  # owners only
    for layer in (5, 6, 7):
        owner = cfg.kv_owner(layer)
        assert all(a.data_ptr() == b.data_ptr()
                   for a, b in zip(pool.rows(layer), pool.rows(owner), strict=True))
    # a sharing layer projects queries only; its MLP is twice as wide
    q_rows = cfg.num_heads * cfg.head_dim_of("global")
    assert model.weights.layers[7].qkv.shape == (q_rows, cfg.hidden_size)
    assert model.weights.layers[7].down.shape == (cfg.hidden_size, 2 * cfg.intermediate_size)


def test_k_eq_v_layers_project_no_values(tmp_path) -> None:
    model = load_model(write_checkpoint("k_eq_v", tmp_path), torch.float32, "cpu", False)
    cfg, layers = model.config, model.weights.layers
    assert cfg.k_eq_v_kinds == {"global"} and cfg.kv_row("global") == (1, 32)
    assert layers[2].qkv.shape == ((4 + 1) * 32, 64)  # q and k of the full layer
    assert layers[0].qkv.shape == ((4 + 2 * 2) * 16, 64)  # sliding: q, k and v
