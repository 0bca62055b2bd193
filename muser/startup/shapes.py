"""The shapes the warm-up runs (muser/startup/warmup.py): one forward of every shape serving
can run, so that each kernel, projection pick and graph it needs is seen before serving.

Prefill chunks of one sequence, 1 .. prefill_chunk rows (each width up to the backend's
exact-rows limit, then per power-of-two bucket its widest chunk: the kernels take row counts,
positions and offsets into the step's metadata unspecialized, so one width stands for its
bucket), each with nothing cached and with a cached prefix; one sequence whose ring wraps, then
a chunk of every width past the wrap; steps of several prompts' chunks up to max_batched_tokens
rows; mixed steps (a batch of decode rows of every size bucket beside a chunk); a short workload
made by the scheduler itself (requests arriving one per step, so the decode group takes every
size beside chunks with cached prefixes); decode steps of every batch bucket (graphs) or every
batch size up to the exact-rows limit and each bucket's widest (eager).
"""

from __future__ import annotations

import torch

from muser.config import EngineConfig
from muser.core import SamplingParams, Status
from muser.graphs import graph_batch_sizes
from muser.runner import Runner
from muser.scheduler import Scheduler
from muser.sequence import Sequence

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


@torch.inference_mode()
def exercise_shapes(runner: Runner, widths: list[int], exact_rows: int) -> None:
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
    scheduled(runner, engine.decode_waiting_chunk)
    if runner.graphs is not None:
        if not runner.graphs.is_captured:
            for bs in graph_batch_sizes(runner.engine.max_num_seqs):
                runner.graphs.forward_padded(bs)
        return
    for bs in decode_sizes(runner.engine.max_num_seqs, exact_rows):
        _together(runner, [1] * bs, repeat=2)


def scheduled(runner: Runner, waiting_chunk: int | None) -> None:
    """The steps the scheduler itself makes, its prefill rows beside decodes capped at
    `waiting_chunk` (None: prefill_chunk): max_num_seqs requests arriving one per step (prompts
    of 1 .. ~600 rows, the first one wrapping the ring), each decoding until the last has
    arrived, so every decode-group size meets chunks with cached prefixes beside it."""
    e, window = runner.engine, runner.cfg.sliding_window
    n = min(e.max_num_seqs, len(runner.free_slots))
    room = e.max_model_len - 2 * n - 2
    lengths = [min(room, window + 37)] + [min(room, (97 * i) % 600 + 1) for i in range(1, n)]
    pending = [Sequence([_TOKEN] * m, SamplingParams(max_tokens=n - i + 1))
               for i, m in enumerate(lengths)]
    sched = Scheduler(n, e.prefill_chunk, waiting_chunk or e.prefill_chunk,
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
