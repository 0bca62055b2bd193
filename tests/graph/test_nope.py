"""NoPE full-attention layers (ModelConfig.nope_kinds): a tiny model of muse-glimmer's pattern
(3 sliding layers to 1 full one without RoPE) against the float64 reference, and the preset."""

from __future__ import annotations

import dataclasses

import torch

from muser.config import EngineConfig, ModelConfig, gemma3_layer_kinds
from muser.graph.weights import random_weights
from muser.presets import num_parameters, preset
from muser.runner import Runner
from tests.error_bounds import U, gamma
from tests.graph.reference import reference_logits

W = 8
TINY = ModelConfig(
    architecture="gemma3", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=8,
    num_heads=4, num_kv_heads=2, head_dim=16, layer_kinds=gemma3_layer_kinds(8, 4),
    sliding_window=W, rope_theta=1e4, rope_local_theta=1e4, query_pre_attn_scalar=16,
    nope_kinds=frozenset({"global"}),
)
ROPE = dataclasses.replace(TINY, nope_kinds=frozenset())

# Error model (as tests/ops/test_layer_graph.py's): each float32 op on a logit's path (per
# layer: norm, QKV, QK-norm + RoPE, attention, O + add-norm, gate_up + GeGLU, down + add-norm;
# then the final norm and the head) is within ATOL_OP + RTOL_OP * |exact| of its exact value:
# a few roundings of the output and of intermediates (8u), and a sum of at most K = 128 terms
# (the intermediate size; attention sums fewer keys) of magnitude ~1, gamma_K. Every residual
# add is followed by an RMSNorm and the random projections are scaled by 1 / sqrt(fan-in), so
# an op passes its input's error on at about unit gain: the errors add up over the path.
OPS_ON_PATH = 7 * TINY.num_layers + 2
ATOL_OP, RTOL_OP = 8 * U + gamma(128), 8 * U
ATOL, RTOL = OPS_ON_PATH * ATOL_OP, OPS_ON_PATH * RTOL_OP


def _logits(cfg: ModelConfig, ids: list[int], chunk: int) -> torch.Tensor:
    """muser's CPU float32 logits at every position, prefilled in chunks of `chunk` rows."""
    engine = EngineConfig.for_device(device="cpu", dtype="float32", kv_dtype="float32",
                                     max_num_seqs=1, max_model_len=64, page_size=8)
    runner = Runner(cfg, engine, random_weights(cfg, torch.float32, "cpu", seed=0))
    seq = runner.allocate()
    pieces = [ids[start:start + chunk] for start in range(0, len(ids), chunk)]
    return torch.cat([runner.forward([seq], [p], logit_rows=list(range(len(p))))
                      for p in pieces])


def _excess(got: torch.Tensor, want: torch.Tensor) -> float:
    """max of |got - want| - (ATOL + RTOL |want|): <= 0 within the error model."""
    return ((got.double() - want).abs() - (ATOL + RTOL * want.abs())).max().item()


def test_tiny_nope_model_matches_float64_reference() -> None:
    ids = torch.randint(0, TINY.vocab_size, (5 * W + 3,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    weights = random_weights(TINY, torch.float32, "cpu", seed=0)
    got = _logits(TINY, ids, chunk=len(ids))
    assert _excess(got, reference_logits(TINY, weights, ids)) <= 0
    # NoPE is in effect: the same weights with RoPE on the full layers are far outside it,
    # while the RoPE model itself matches its reference as closely
    assert _excess(got, reference_logits(TINY, weights, ids, ("sliding", "global"))) > 100 * ATOL
    rope = _logits(ROPE, ids, chunk=len(ids))
    assert _excess(rope, reference_logits(ROPE, weights, ids)) <= 0
    # one chunk, 3-row chunks and token by token: the same bits, as for RoPE layers
    for chunk in (3, 1):
        assert torch.equal(_logits(TINY, ids, chunk), got)


def test_muse_glimmer_preset() -> None:
    cfg = preset("muse-glimmer")
    assert cfg.num_layers == 52 and cfg.nope_kinds == {"global"}
    assert cfg.layers_of("global") == list(range(3, 52, 4))  # 13 full layers, 3:1
    assert len(cfg.layers_of("sliding")) == 39 and cfg.head_dim == 128
    assert num_parameters(cfg) == 27_856_504_832
    assert abs(num_parameters(cfg) / 27_854_794_240 - 1) < 1e-4  # the book's count
