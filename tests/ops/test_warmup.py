"""After the warm-up, nothing is tuned on the request path: the tuning entry point
(`linear.tune`) is reached while warming up and never again across a mixed workload of
prompts of many lengths, adaptive chunks and decode batches of every size. The projections run
through the Triton launchers (the interpreter here); every other op is the reference."""

from __future__ import annotations

import importlib
import types

import torch

from muser.config import EngineConfig, ModelConfig, gemma3_layer_kinds
from muser.core import SamplingParams, Status
from muser.graph.decoder import Decoder
from muser.graph.weights import random_weights
from muser.ops import ref
from muser.ops import triton as triton_ops
from muser.runner import Runner
from muser.scheduler import Scheduler
from muser.sequence import Sequence
from muser.startup.shapes import prefill_widths
from muser.startup.warmup import prepare

CFG = ModelConfig(
    architecture="gemma3", vocab_size=32, hidden_size=16, intermediate_size=16, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=16, layer_kinds=gemma3_layer_kinds(1),
    sliding_window=8, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=16.0,
)
ENGINE = EngineConfig.for_device(device="cpu", dtype="float32", kv_dtype="float32",
                                 max_num_seqs=3, prefill_chunk=12, decode_waiting_chunk=4,
                                 max_model_len=64, page_size=16)
PROJECTIONS = ("linear", "linear_geglu", "linear_add_rms_norm")
linear = importlib.import_module("muser.ops.triton.linear")  # the module, not the op
linear_fp8 = importlib.import_module("muser.ops.triton.linear_fp8")


def _runner(fp8: bool = False) -> Runner:
    ops = types.SimpleNamespace(**{n: getattr(ref, n) for n in dir(ref) if not n.startswith("_")})
    for name in (*PROJECTIONS, "tuning"):
        setattr(ops, name, getattr(triton_ops, name))
    runner = Runner(CFG, ENGINE, random_weights(CFG, torch.float32, "cpu", seed=0))
    runner.model = Decoder(CFG, random_weights(CFG, torch.float32, "cpu", seed=0, fp8=fp8),
                           runner.pool, ops)
    return runner


def _serve(runner: Runner, prompts: list[int], max_tokens: list[int]
           ) -> list[tuple[str, int, int]]:
    """Greedy requests admitted one every other step -> (kind, decode rows, rows) of every
    step."""
    sched = Scheduler(ENGINE.max_num_seqs, ENGINE.prefill_chunk, ENGINE.decode_waiting_chunk)
    pending = [Sequence([(7 * i + j) % CFG.vocab_size for j in range(n)],
                       SamplingParams(max_tokens=m)) for i, (n, m) in enumerate(
                           zip(prompts, max_tokens))]
    seqs, steps = {}, []
    while pending or sched.has_work:
        if pending and len(steps) % 2 == 0:
            sched.add(pending.pop(0))
        batch = sched.schedule()
        if batch is None:
            continue
        for req in batch.reqs:
            if req.uid not in seqs:
                seqs[req.uid] = runner.allocate()
        inputs = [r.all_ids[r.num_cached:r.num_cached + n]
                  for r, n in zip(batch.reqs, batch.num_tokens)]
        logits = runner.forward([seqs[r.uid] for r in batch.reqs], inputs)
        steps.append((batch.kind, batch.num_decode, sum(batch.num_tokens)))
        for req, ids, row in zip(batch.reqs, inputs, logits):
            req.num_cached += len(ids)
            if req.num_pending:
                continue
            req.status = Status.DECODE
            req.output_ids.append(int(row.argmax()))
            if len(req.output_ids) == req.sampling.max_tokens:
                sched.remove(req.uid)
                runner.free(seqs.pop(req.uid))
    return steps


def test_nothing_is_tuned_after_the_warm_up() -> None:
    runner = _runner()
    before = linear.STATS.tuned
    prepare(runner)
    warmed = linear.STATS.tuned
    keys = set(linear.PICKS.pick)
    assert warmed > before
    steps = _serve(runner, prompts=[1, 3, 9, 20, 37, 5, 12, 13], max_tokens=[3, 6, 2, 5, 4, 3, 2, 4])
    assert linear.STATS.tuned == warmed
    assert set(linear.PICKS.pick) == keys
    widths = {rows for kind, _, rows in steps if kind != "decode"}
    decodes = {num_decode for _, num_decode, _ in steps}
    kinds = {kind for kind, _, _ in steps}
    assert len(widths) >= 5 and decodes >= {1, 2} and kinds == {"decode", "prefill", "mixed"}


def test_nothing_is_tuned_after_the_warm_up_fp8() -> None:
    """The same with FP8 projections, whose picks linear_fp8 keeps."""
    runner = _runner(fp8=True)
    before = linear.STATS.tuned
    prepare(runner)
    warmed, keys = linear.STATS.tuned, set(linear_fp8.PICKS.pick)
    assert warmed > before and keys
    _serve(runner, prompts=[1, 3, 9, 20, 37, 5, 12, 13], max_tokens=[3, 6, 2, 5, 4, 3, 2, 4])
    assert linear.STATS.tuned == warmed
    assert set(linear_fp8.PICKS.pick) == keys


def test_prefill_widths_cover_every_bucket() -> None:
    widths = prefill_widths(EngineConfig.for_device("cpu", prefill_chunk=512), 8)
    assert widths == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256, 512]
    assert prefill_widths(EngineConfig.for_device("cpu", prefill_chunk=100,
                                                  max_model_len=4096), 8)[-3:] == [32, 64, 100]


def test_default_chunk_per_backend_and_its_warm_up() -> None:
    """The CPU chunks prompts by 512 rows; a GPU by its step budget (2,048), so a lone prompt's
    chunk fills the step, and its warm-up covers chunks of every width up to that (the buckets
    past 512 too); a chunk given by the user is kept on either."""
    cpu, gpu = EngineConfig.for_device(device="cpu"), EngineConfig.for_device(device="cuda")
    assert (cpu.prefill_chunk, cpu.max_batched_tokens) == (512, 512)
    assert gpu.prefill_chunk == gpu.max_batched_tokens == 2048
    assert prefill_widths(gpu, 8)[-3:] == [512, 1024, 2048]
    assert EngineConfig.for_device(device="cuda", prefill_chunk=512).prefill_chunk == 512
