"""The whole layer graph through the Triton ops (interpreter on CPU, compiled on CUDA) equals
the reference ops, for prefill chunks that wrap the sliding ring and for decode steps."""

from __future__ import annotations

import pytest
import torch

import muser.ops.triton as triton_ops
from muser.config import EngineConfig, ModelConfig, gemma3_layer_kinds
from muser.graph.weights import ModelWeights, random_weights, with_fp8_head
from muser.ops import ref
from muser.ops.fp8 import Fp8Matrix
from muser.runner import Runner

from opcheck import DEVICE, TOL

# Both graphs run float32; each op on a logit's path (per layer: norm, QKV, QK-norm + RoPE,
# attention, O + add-norm, gate_up + GeGLU, down + add-norm; then the embedding, final norm and
# head) is within TOL[float32] of the exact result on either side, so the two differ by at most
# twice that per op. Every residual add is followed by an RMSNorm and the random projections
# are scaled by 1 / sqrt(fan-in), so an op passes its input's error on at about unit gain
# (activations of magnitude ~1): the differences add up over the path.
OPS_ON_PATH = 7 * 2 + 2
GRAPH_ATOL, GRAPH_RTOL = (2 * OPS_ON_PATH * t for t in TOL[torch.float32])

CFG = ModelConfig(
    architecture="gemma3", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=32, layer_kinds=gemma3_layer_kinds(2, pattern=2),
    sliding_window=8, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=32.0,
)


def _to(weights: ModelWeights, device: str) -> ModelWeights:
    layers = [w.map(lambda m: m.to(device)) for w in weights.layers]
    return ModelWeights(weights.embed.to(device), weights.final_norm.to(device), layers)


def _dequantized(weights: ModelWeights) -> ModelWeights:
    """FP8 projections (and an FP8 tied head) as their float32 values (data * scales)."""
    def dense(m):
        return m.dequantize() if isinstance(m, Fp8Matrix) else m

    layers = [w.map(dense) for w in weights.layers]
    return ModelWeights(dense(weights.embed), weights.final_norm, layers)


def _run(ops_module, chunks: list[int], decode_steps: int, device: str,
         fp8: bool = False, page_size: int = 16, fp8_head: bool = False,
         kv_dtype: str = "float32") -> torch.Tensor:
    """`fp8`: the projections quantized (random_weights(fp8=True)), `fp8_head` the tied head
    too (with_fp8_head); the Triton ops read them as FP8, the reference (and the CPU backend
    the runner starts with) their float32 values."""
    engine = EngineConfig.for_device(device=device, dtype="float32", kv_dtype=kv_dtype,
                                     max_num_seqs=2, max_model_len=64, page_size=page_size,
                                     enforce_eager=True)
    weights = random_weights(CFG, torch.float32, "cpu", seed=3, fp8=fp8)
    weights = _to(with_fp8_head(weights) if fp8_head else weights, device)
    runner = Runner(CFG, engine, _dequantized(weights))
    if ops_module is not None:  # the weights as this backend reads them
        runner.model.ops = ops_module
        runner.model.weights = ops_module.prepare_weights(
            weights if ops_module is triton_ops else _dequantized(weights))
    ids = torch.randint(0, CFG.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    seq, logits, pos = runner.allocate(), [], 0
    for n in chunks:
        logits.append(runner.forward([seq], [ids[pos:pos + n].tolist()], all_logits=True))
        pos += n
    for _ in range(decode_steps):
        logits.append(runner.forward([seq], [[int(ids[pos])]]))
        pos += 1
    return torch.cat(logits)


# pages of 16 rows: a full layer's key tiles straddle pages and are gathered; of 128 (a tile's
# rows on the CPU, where the runner's tile is 128): attended in place in the cache
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("chunks", [[5, 9, 2]])  # in place, staging (wrapped), short
def test_graph_triton_equals_reference(chunks, page_size):
    expect = _run(ref, chunks, 3, "cpu", page_size=page_size)
    got = _run(triton_ops, chunks, 3, DEVICE, page_size=page_size)
    assert got.shape == expect.shape
    torch.testing.assert_close(got.cpu(), expect.cpu(), atol=GRAPH_ATOL, rtol=GRAPH_RTOL)


@pytest.mark.parametrize("fp8_head", [False, True])
def test_graph_fp8_equals_reference_on_its_values(fp8_head):
    """FP8 projections through the Triton graph (the FP8 GEMV for decode rows and chunks of
    up to 8, the dequant route for wider chunks: float32 models run no scaled_mm) equal the
    reference graph on the same weights' float32 values; with an FP8 head, its embedding
    lookup and LM head read the same codes."""
    expect = _run(ref, [5, 9, 2], 3, "cpu", fp8=True, fp8_head=fp8_head)
    got = _run(triton_ops, [5, 9, 2], 3, DEVICE, fp8=True, fp8_head=fp8_head)
    assert got.shape == expect.shape
    torch.testing.assert_close(got.cpu(), expect.cpu(), atol=GRAPH_ATOL, rtol=GRAPH_RTOL)


@pytest.fixture
def fp8_kv_allowed(monkeypatch):
    """The CPU refuses an FP8 cache unless the ops are the reference's (EngineConfig): the
    runner here starts on them, and the test hands its model the Triton ops."""
    monkeypatch.setenv("MUSER_OPS", "ref")


@pytest.mark.parametrize("page_size", [16, 128])
def test_graph_fp8_kv_is_bitwise_across_chunkings(fp8_kv_allowed, page_size):
    """An FP8 KV cache through the Triton graph (rings and pages of packed codes, stored by the
    QK-norm pair, the staging gather and decode attention): one chunk, chunks taking the
    in-place, staging and short routes and the decode rows after them give the same logits bit
    for bit. Against the reference graph over an FP8 cache, and a float32 cache: logits of
    magnitude ~1 move by e4m3's relative precision (2^-4 a value, muser/ops/kv_fp8.py) times
    the few values that dominate each output (measured 0.07 here against float32); an ulp's
    difference upstream may flip a code between the two graphs."""
    def run(ops_module, chunks, kv_dtype="fp8"):
        return _run(ops_module, chunks, 3, DEVICE, page_size=page_size, kv_dtype=kv_dtype)

    whole = run(triton_ops, [16])
    for chunks in ([5, 9, 2], [8, 3, 5]):
        assert torch.equal(run(triton_ops, chunks), whole), chunks
    expect = run(ref, [5, 9, 2])
    assert (whole - expect).abs().max() < 2.0**-3
    assert (whole - run(triton_ops, [16], "float32")).abs().max() < 2.0**-3
