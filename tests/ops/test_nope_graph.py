"""The NoPE model of tests/graph/test_nope.py through the Triton ops (interpreter on CPU,
compiled on CUDA), prefill chunks that wrap the sliding ring and decode steps, against the
float64 reference: the GPU graph runs NoPE layers too."""

from __future__ import annotations

import dataclasses

import torch

import muser.ops.triton as triton_ops
from muser.config import EngineConfig, gemma3_layer_kinds
from muser.graph.weights import ModelWeights, random_weights
from muser.runner import Runner
from tests.graph.reference import reference_logits
from tests.graph.test_nope import TINY

from opcheck import DEVICE, TOL

CFG = dataclasses.replace(TINY, num_layers=4, layer_kinds=gemma3_layer_kinds(4, 4))


def test_nope_graph_through_triton_ops() -> None:
    """Error model of tests/graph/test_nope.py (7 ops a layer, then 2) with the kernel tests'
    per-op tolerance (opcheck.TOL: sums of up to 4,096 terms), one side exact."""
    weights = random_weights(CFG, torch.float32, "cpu", seed=0)
    layers = [w.map(lambda m: m.to(DEVICE)) for w in weights.layers]
    on_device = ModelWeights(weights.embed.to(DEVICE), weights.final_norm.to(DEVICE), layers)
    engine = EngineConfig.for_device(device=DEVICE, dtype="float32", kv_dtype="float32",
                                     max_num_seqs=1, max_model_len=64, page_size=8,
                                     enforce_eager=True)
    runner = Runner(CFG, engine, on_device)
    runner.model.ops, runner.model.weights = triton_ops, triton_ops.prepare_weights(on_device)
    ids = torch.randint(0, CFG.vocab_size, (15,), generator=torch.Generator().manual_seed(2))
    ids = ids.tolist()
    seq, got, pos = runner.allocate(), [], 0
    for n in (5, 9, 1):  # in place, then staging (the ring wraps), then a decode step
        got.append(runner.forward([seq], [ids[pos:pos + n]], all_logits=True))
        pos += n
    atol, rtol = ((7 * CFG.num_layers + 2) * t for t in TOL[torch.float32])
    torch.testing.assert_close(torch.cat(got).cpu().double(),
                               reference_logits(CFG, weights, ids), atol=atol, rtol=rtol)
