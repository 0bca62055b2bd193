"""The runner's warm-up: before the engine reports ready, every shape serving can run is seen
once, so nothing is compiled, tuned or captured on the request path.

    picks ..... stored projection picks (tuning cache, then the shipped table)
    compile ... the kernels an earlier warm-up of this configuration listed, taken from
                Triton's cache (muser/ops/triton/kernel_list.py); without such a list, one
                pass over every shape in compile-only mode: each kernel, and every candidate
                of a shape without a pick, compiled (or read from Triton's cache); either way
                loaded onto the device on a thread pool
    tune ...... the same pass run for real: shapes without a pick are timed (and stored);
                when none was, the kernels compiled so far are listed for the next start
    capture ... CUDA graphs of every decode batch bucket (`capture`, apart from the phases
                before it (`exercise`): the runner sizes its KV pages in between, from the
                peak the exercise measured, and graphs hold the pages' addresses)

The shapes: prefill chunks of one sequence, 1 .. prefill_chunk rows (each width up to the
backend's exact-rows limit, then per power-of-two bucket its widest chunk: the kernels take row
counts, positions and offsets into the step's metadata unspecialized, so one width stands for
its bucket), each with nothing cached and with a cached prefix; one sequence whose ring wraps,
then a chunk of every width past the wrap; steps of several prompts' chunks up to
max_batched_tokens rows; mixed steps (a batch of decode rows of every size bucket beside a
chunk); a short workload made by the scheduler itself (requests arriving one per step, so the
decode group takes every size beside chunks with cached prefixes); decode steps of every batch
bucket (graphs) or every batch size up to the exact-rows limit and each bucket's widest
(eager). Backends without a
`tuning` namespace (the CPU's) skip the warm-up.
"""

from __future__ import annotations

from typing import Any

import torch

from muser.config import EngineConfig
from muser.graphs import graph_batch_sizes
from muser.runner import Runner
from muser.startup import StartupLog

_TOKEN = 2  # any id of the vocabulary: the warm-up's outputs are never read


def _covering(limit: int, exact_rows: int) -> list[int]:
    """Sizes whose shapes cover every size 1 .. limit: each size up to exact_rows, then
    doubling buckets (the last one `limit`)."""
    sizes = set(range(1, min(exact_rows, limit) + 1))
    bucket = 2 * exact_rows
    while bucket // 2 < limit:
        sizes.add(min(bucket, limit))
        bucket *= 2
    return sorted(sizes)


def prefill_widths(engine: EngineConfig, exact_rows: int) -> list[int]:
    """Chunk widths whose shapes cover every chunk of 1 .. prefill_chunk rows."""
    return _covering(min(engine.prefill_chunk, engine.max_model_len - 1), exact_rows)


def step_widths(engine: EngineConfig, exact_rows: int) -> list[int]:
    """Step widths (every sequence's rows together) whose projection shapes cover every
    step of 1 .. max_batched_tokens rows."""
    return _covering(engine.max_batched_tokens, exact_rows)


def decode_sizes(max_num_seqs: int, exact_rows: int) -> list[int]:
    """Eager decode batch sizes whose shapes cover every batch of 1 .. max_num_seqs rows."""
    return _covering(max_num_seqs, exact_rows)


def prepare(runner: Runner, log: StartupLog | None = None) -> dict[str, Any]:
    """Warm the runner up (phases reported to `log`) -> what each phase did."""
    log = log or StartupLog()
    exercise(runner, log)
    capture(runner, log)
    return dict(log.details)


def exercise(runner: Runner, log: StartupLog) -> bool:
    """The picks, compile and tune phases: every shape run once (the runner measures its
    workspace here, and may size its KV pages after) -> False when the backend has no warm-up."""
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
                    _exercise(runner, widths, tuning.EXACT_ROWS)
                detail["kernels"] = len(mode.raw_futures)
    with log.phase("tune") as detail:
        before = tuning.stats()
        _exercise(runner, widths, tuning.EXACT_ROWS)
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


@torch.inference_mode()
def _exercise(runner: Runner, widths: list[int], exact_rows: int) -> None:
    """One forward of every shape serving can run (see the module docstring)."""
    room = runner.engine.max_model_len - 1
    for n in widths:
        _prefill(runner, [n, n], room)
    window = runner.cfg.sliding_window
    widest = widths[-1]
    _prefill(runner, [widest] * (window // widest + 1) + widths[::-1], room)
    engine = runner.engine
    for n in step_widths(engine, exact_rows):
        if n > widest:  # several prompts' chunks in one step
            _together(runner, [widest] * (n // widest) + [n % widest] * (n % widest > 0))
    cap = min(engine.decode_waiting_chunk or widest, widest, room)
    for bs in decode_sizes(engine.max_num_seqs - 1, exact_rows):  # mixed: + one chunk
        _together(runner, [1] * bs + [min(cap, engine.max_batched_tokens - bs)])
    scheduled(runner)
    if runner.graphs is not None:
        if not runner.graphs.is_captured:
            for bs in graph_batch_sizes(runner.engine.max_num_seqs):
                runner.graphs.forward_padded(bs)
        return
    for bs in decode_sizes(runner.engine.max_num_seqs, exact_rows):
        _together(runner, [1] * bs, repeat=2)


def scheduled(runner: Runner) -> None:
    """The steps the scheduler itself makes: max_num_seqs requests arriving one per step
    (prompts of 1 .. ~600 rows, the first one wrapping the ring), each decoding until the last
    has arrived, so every decode-group size meets chunks with cached prefixes beside it."""
    from muser.core import SamplingParams, Status
    from muser.scheduler import Scheduler
    from muser.sequence import Sequence

    e, window = runner.engine, runner.cfg.sliding_window
    n = min(e.max_num_seqs, len(runner.free_slots))
    room = e.max_model_len - 2 * n - 2
    lengths = [min(room, window + 37)] + [min(room, (97 * i) % 600 + 1) for i in range(1, n)]
    pending = [Sequence([_TOKEN] * m, SamplingParams(max_tokens=n - i + 1))
               for i, m in enumerate(lengths)]
    sched = Scheduler(n, e.prefill_chunk, e.decode_waiting_chunk or e.prefill_chunk,
                      max_batched_tokens=e.max_batched_tokens, page_size=e.page_size)
    seqs = {}
    try:
        while pending or sched.has_work:
            if pending:
                sched.add(pending.pop(0))
            batch = sched.schedule(runner.pages.num_free)  # NOTE: the warm-up's small pool
            for req in batch.preempted:
                runner.free(seqs.pop(req.uid))
            for req in batch.reqs:
                if req.uid not in seqs:
                    seqs[req.uid] = runner.allocate()
            runner.forward([seqs[r.uid] for r in batch.reqs],
                           [[_TOKEN] * m for m in batch.num_tokens])
            for req, m in zip(batch.reqs, batch.num_tokens):
                req.num_cached += m
                if req.num_pending == 0:
                    req.status = Status.DECODE
                    req.output_ids.append(_TOKEN)
                    if len(req.output_ids) >= req.sampling.max_tokens:
                        sched.finish(req)
                        runner.free(seqs.pop(req.uid))
    finally:
        for seq in seqs.values():
            runner.free(seq)


def _together(runner: Runner, rows: list[int], repeat: int = 1) -> None:
    """`repeat` steps of fresh sequences side by side, rows[i] new rows for sequence i (as
    many as the runner has slots for), then free them."""
    seqs = [runner.allocate() for _ in rows[:len(runner.free_slots)]]
    try:
        for _ in range(repeat):
            runner.forward(seqs, [[_TOKEN] * n for n in rows[:len(seqs)]])
    finally:
        for seq in seqs:
            runner.free(seq)


def _prefill(runner: Runner, chunks: list[int], room: int) -> None:
    """Prefill one fresh sequence chunk by chunk while the context has room, then free it."""
    seq = runner.allocate()
    try:
        for n in chunks:
            if seq.num_cached + n > room:
                break
            runner.forward([seq], [[_TOKEN] * n])
    finally:
        runner.free(seq)
