"""Gemma 4 text models on the CPU against transformers' float32 reference, on tiny
random checkpoints transformers writes itself (tests/gemma4/checkpoints.py): dense with the
full layers' own geometry and proportional RoPE, K=V, PLE with KV sharing, and the
mixture of experts (26B-A4B's block). Prompts run
past the sliding window; logits at every position are within the error model's bound, and 64
greedy tokens equal transformers' generate.

Error model (as tests/graph/test_nope.py's): each float32 op on a logit's path is within
ATOL_OP + RTOL_OP * |exact| of its exact value: a few roundings of its output and of its
intermediates (8u), and one sum of at most K_MAX terms of magnitude ~1 (gamma_K_MAX), whatever
order the sum runs in; the longest reduction is the double-wide MLP's down projection (2 * 96
terms; attention sums at most 50 keys, the head 64). Every residual add meets an RMSNorm and the
projections are scaled by 1 / sqrt(fan-in), so an op passes its input's error on at about unit
gain and the errors add over the path: OPS_PER_LAYER ops a layer (norm, QKV, V norm, QK-norm +
RoPE, attention, O + add-norm, gate_up + GeGLU, down + add-norm; PLE's gate, GeGLU and
projection + add-norm; the layer scalar and its norm), OPS_PER_MOE more on a mixture-of-experts
layer (the dense MLP's own norm; the router's norm, scores, softmax and weights; the experts'
norm, gate_up + GeGLU, down, weighted sum and norm; the two outputs' sum: counted for every
variant, so the one bound is the loosest's), the per-layer inputs' three (projection, norm, sum)
and the final norm and head. The experts' weights carry the router's error, but a token's
experts are the same on both sides: the checkpoint's router scores are a few units wide, far
from a tie between the k-th and the next expert. muser and transformers each sum in their own order, so
their distance is within twice one side's bound. The bound is derived, not measured: the
largest difference these checkpoints show is 0.030 of it (dense), 0.0075 with experts.
"""

from __future__ import annotations

import pytest
import torch

from muser.config import EngineConfig
from muser.loading import LoadedModel, load_model
from muser.runner import Runner
from tests.error_bounds import U, gamma
from tests.gemma4.checkpoints import VARIANTS, W, reference_model, write_checkpoint

K_MAX = 2 * 96
OPS_PER_LAYER = 12
OPS_PER_MOE = 10
OPS_ON_PATH = (OPS_PER_LAYER + OPS_PER_MOE) * 8 + 3 + 2
ATOL_OP, RTOL_OP = 8 * U + gamma(K_MAX), 8 * U
ATOL, RTOL = 2 * OPS_ON_PATH * ATOL_OP, 2 * OPS_ON_PATH * RTOL_OP
PROMPT_LENGTHS = (2 * W + 3, 4 * W + 1, 6 * W + 2)  # every one past the window
STEPS = 64


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(3, 512, (length - 1,), generator=gen).tolist()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, LoadedModel]:
    directory = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, load_model(directory, torch.float32, "cpu", progress=False)


def runner_of(model: LoadedModel, num_seqs: int = 1) -> Runner:
    engine = EngineConfig.for_device(device="cpu", dtype="float32", kv_dtype="float32",
                                     max_num_seqs=num_seqs, max_model_len=160, page_size=8)
    return Runner(model.config, engine, model.weights)


def test_logits_within_the_error_model_of_transformers(variant) -> None:
    name, model = variant
    reference, runner = reference_model(name), runner_of(model)
    for n, length in enumerate(PROMPT_LENGTHS):
        ids = prompt(length, n)
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].double()
        seq = runner.allocate()
        got = runner.forward([seq], [ids], logit_rows=list(range(length))).double()
        runner.free(seq)
        excess = ((got - want).abs() - (ATOL + RTOL * want.abs())).max().item()
        assert excess <= 0, f"{name}, {length} tokens: {excess:.3g} past the bound"
        assert want.abs().max() > 1.0  # logits that say something


def test_greedy_tokens_equal_transformers_generate(variant) -> None:
    name, model = variant
    reference, runner = reference_model(name), runner_of(model)
    for n, length in enumerate(PROMPT_LENGTHS):
        ids = prompt(length, 10 + n)
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        want = out[0, length:].tolist()
        seq = runner.allocate()
        logits = runner.forward([seq], [ids])
        got = []
        for _ in range(STEPS):
            got.append(int(logits[-1].argmax()))
            logits = runner.forward([seq], [[got[-1]]])
        runner.free(seq)
        assert got == want, f"{name}, {length} tokens"
