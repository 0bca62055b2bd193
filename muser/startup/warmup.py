"""The warm-up's phases: before the engine reports ready, every shape serving can run
(muser/startup/shapes.py) is seen once, so nothing is compiled, tuned or captured on the
request path.

    picks ..... stored projection picks (tuning cache, then the shipped table)
    compile ... the kernels an earlier warm-up of this configuration listed, taken from
                Triton's cache (muser/ops/triton/kernel_list.py); without such a list, one
                pass over every shape in compile-only mode: each kernel, and every candidate
                of a shape without a pick, compiled (or read from Triton's cache); either way
                loaded onto the device on a thread pool
    tune ...... the same pass run for real: shapes without a pick are timed (and stored);
                when none was, the kernels compiled so far are listed for the next start
    capture ... CUDA graphs of every decode batch bucket (`capture`, apart from the phases
                before it (`exercise`): the KV pages are sized in between, from the peak the
                exercise measured, and graphs hold the pages' addresses: muser/startup/start.py)

Backends without a `tuning` namespace (the CPU's) skip the warm-up.
"""

from __future__ import annotations

from typing import Any

from muser.runner import Runner
from muser.startup.log import StartupLog
from muser.startup.shapes import exercise_shapes, prefill_widths


def prepare(runner: Runner, log: StartupLog | None = None) -> dict[str, Any]:
    """Warm the runner up (phases reported to `log`) -> what each phase did."""
    log = log or StartupLog()
    exercise(runner, log)
    capture(runner, log)
    return dict(log.details)


def exercise(runner: Runner, log: StartupLog) -> bool:
    """The picks, compile and tune phases: every shape run once (the startup measures the
    workspace here, and may size the KV pages after) -> False when the backend has no
    warm-up."""
    tuning = getattr(runner.model.ops, "tuning", None)
    if tuning is None:
        return False
    on_gpu = runner.device.type == "cuda"
    widths = prefill_widths(runner.engine, tuning.EXACT_ROWS)
    if on_gpu:
        with log.phase("picks") as detail:
            detail.update(tuning.load(runner.device))
        kernels = tuning.listed(runner.device, repr((runner.cfg, runner.engine)))
        since = len(tuning.JIT.compiled)
        with log.phase("compile") as detail:
            detail["listed"] = tuning.load_listed(kernels, runner.device)
            if not detail["listed"]:
                with tuning.compiling(runner.device) as mode:
                    exercise_shapes(runner, widths, tuning.EXACT_ROWS)
                detail["kernels"] = len(mode.raw_futures)
    with log.phase("tune") as detail:
        before = tuning.stats()
        exercise_shapes(runner, widths, tuning.EXACT_ROWS)
        after = tuning.stats()
        detail["shapes timed"] = after["tuned"] - before["tuned"]
        if on_gpu:
            detail["kernels loaded"] = after["compiles"] - before["compiles"]
            path = tuning.save(runner.device)
            if path is not None:
                detail["saved"] = str(path)
            elif (added := tuning.save_listed(kernels, runner.device, since)):
                detail["listed"] = added
    return True


def capture(runner: Runner, log: StartupLog) -> None:
    """The capture phase: CUDA graphs of every decode bucket, over the KV tensors as they are
    now (allocate them first). Backends without a warm-up capture nothing."""
    if runner.graphs is None or getattr(runner.model.ops, "tuning", None) is None:
        return
    with log.phase("capture") as detail:
        runner.graphs.capture()
        detail["graphs"] = len(runner.graphs.graphs)


