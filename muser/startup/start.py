"""Getting a runner ready to serve: the startup drives the runner, which knows nothing of it.

On the CPU, a first start on a machine builds the C kernels as a phase of its own, a line at
least every few seconds (muser/ops/native/build.py).

On a GPU, in order: the warm-up's picks, compile and tune phases run every shape serving can
run (muser/startup/warmup.py), their peak allocation measured; the KV pages are sized from the
memory left beside that workspace (unless num_pages is given); the decode graphs are captured
over the final pages; the prefill-row cap while sequences decode is measured (unless
decode_waiting_chunk is given: muser/startup/waiting_chunk.py) and the scheduler-made steps run
again under it. Then, on any device, the prefix cache forgets what the warm-up stored and the
memory report is made. What was done and measured comes back as one StartupRecord, handed to
the runner; no configuration is changed.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from muser.config import EngineConfig, ModelConfig
from muser.errors import ConfigError
from muser.graph.weights import ModelWeights
from muser.ops import native
from muser.runner import Runner
from muser.startup import waiting_chunk
from muser.startup.log import StartupLog
from muser.startup.memory import (
    estimated_workspace,
    kept_bytes,
    memory_report,
    peak_bytes,
    size_kv_pages,
)
from muser.startup.shapes import scheduled
from muser.startup.warmup import capture, exercise
from muser.startup_record import StartupRecord


def start(cfg: ModelConfig, engine: EngineConfig, weights: ModelWeights,
          log: StartupLog | None = None) -> Runner:
    """A runner ready to serve when it returns (its record in `runner.startup`): on a GPU every
    kernel, projection pick and decode graph serving can use is compiled, chosen and captured.
    Phases are reported to `log`."""
    log = log or StartupLog()
    if torch.device(engine.device).type == "cpu" and not native.is_built():
        with log.phase("CPU kernels"):  # NOTE: once per machine; its lines keep the wait loud
            native.build_kernels(lambda line: log.note(f"  {line}"))
    runner = Runner(cfg, engine, weights)
    if engine.speculative != "none":
        _check_speculation(runner)
    runner.ready(warm_up(runner, log))
    return runner


def _check_speculation(runner: Runner) -> None:
    """Speculative decoding is exact where a verify pass's rows are bitwise decode rows: refuse
    it, saying why, on weights and routes where a row's bits depend on its step's width."""
    w = runner.model.weights
    matrices = [w.head] + [m for layer in w.layers for m in layer.parts().values()]
    reason = runner.model.ops.width_inexact(matrices)
    if reason is not None:
        raise ConfigError(f"speculative decoding needs a row's bits to be the same at every "
                          f"step width (docs/exactness.md), and here they are not: {reason}")


def warm_up(runner: Runner, log: StartupLog) -> StartupRecord:
    """Get `runner` ready (see the module docstring) -> what was done and measured."""
    cap = runner.engine.decode_waiting_chunk
    workspace, phases = None, {}
    if runner.device.type == "cuda":
        workspace, cap = _on_gpu(runner, log)
        phases = dict(log.details)
    if runner.prefix is not None:
        runner.prefix.reset(runner.pages)  # NOTE: nothing the warm-up computed is reused
    report = memory_report(runner, workspace)
    log.note(report.pretty())
    e = runner.engine
    if e.kv_host_gb:
        log.note(f"prefix cache host tier: {e.kv_host_gb:g} GiB of "
                 f"{'pinned ' if runner.device.type == 'cuda' else ''}host memory for the "
                 f"pages and checkpoints the device evicts")
    return StartupRecord(MappingProxyType(phases), cap, report)


def note_speculation(log: StartupLog, runner: Runner, draft: Runner | None = None) -> None:
    """State the speculative configuration of `runner` (the target) and its `draft` model's
    runner, if any, in the startup log."""
    e = runner.engine
    if e.speculative == "none":
        return
    rings = (f"sliding rings hold {runner.pool.ring_capacity} rows (window "
             f"{runner.cfg.sliding_window} + {e.num_speculative_tokens})")
    how = "ngram (prompt lookup)"
    if draft is not None:
        d = draft.cfg
        how = (f"draft model {e.speculative_model} ({d.num_layers} layers, hidden "
               f"{d.hidden_size}, window {d.sliding_window}; its own KV: "
               f"{draft.pages.num_free} pages of {e.page_size} rows, rings of "
               f"{draft.pool.ring_capacity} rows, one per sequence slot)")
    log.note(f"speculative decoding: {how}, at most {e.num_speculative_tokens} draft tokens "
             f"per sequence and step, verified exactly; the target's {rings}")


def _on_gpu(runner: Runner, log: StartupLog) -> tuple[int | None, int | None]:
    """Exercise every shape measuring the peak, size the KV pages from the memory left unless
    num_pages is given, capture graphs over the final pages, measure the chunk cap unless it is
    given -> (workspace bytes: activation peak + graph pool, None when the backend has no
    warm-up; the chunk cap)."""
    tuning = getattr(runner.model.ops, "tuning", None)  # NOTE: MUSER_OPS=ref has no tuning
    if tuning is not None:
        tuning.warming()
    ran, peak = peak_bytes(lambda: exercise(runner, log), runner.device)
    if runner.engine.num_pages is None:
        size_kv_pages(runner, peak if ran else estimated_workspace(runner), log)
    graph_pool = kept_bytes(lambda: capture(runner, log), runner.device)
    cap = runner.engine.decode_waiting_chunk
    if ran and cap is None:
        cap = _measure_waiting_chunk(runner, log)
    if ran:
        tuning.serving()
    return (peak + graph_pool if ran else None), cap


def _measure_waiting_chunk(runner: Runner, log: StartupLog) -> int:
    """Choose decode_waiting_chunk from step times measured here (waiting_chunk.py), then run
    the scheduler-made warm-up steps again under that cap -> the cap."""
    with log.phase("chunk cap") as detail:
        cap, measured = waiting_chunk.measure(runner)
        detail.update(cap=cap, **measured)
        scheduled(runner, cap)
    return cap
