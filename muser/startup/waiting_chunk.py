"""The prefill-row cap while sequences decode (decode_waiting_chunk), measured at startup.

A step that carries prefill rows beside the decode rows makes every running stream wait for
them. Left to the GPU's measurement (the flag not given), the cap is chosen from step times
taken on this device, model and batch, right after the warm-up:

    the largest cap whose mixed step (a full batch's decode rows + that many prefill rows)
    takes at most SLOWDOWN x the decode-only step of that batch;
    when none does (a step bound by its fixed per-step costs, e.g. a small model's eager
    step), the cap that delays running streams least per prefill row: the most rows per
    millisecond the mixed step adds over the decode step (fewer, wider mixed steps).

Candidates: powers of two from 64 up to max_batched_tokens less the batch.
"""

from __future__ import annotations

import time

import torch

SLOWDOWN = 2.0
SMALLEST = 64
_TOKEN = 2  # any id of the vocabulary: outputs are never read
_PREFIX = 64  # rows each decoding sequence holds before the timed steps


def candidates(max_batched_tokens: int, batch: int, most: int) -> list[int]:
    """Powers of two from SMALLEST up to the rows a step has beside `batch` decode rows and
    at most `most`."""
    caps, cap = [], SMALLEST
    while cap <= min(max_batched_tokens - batch, most):
        caps.append(cap)
        cap *= 2
    return caps


def choose(decode_ms: float, mixed_ms: dict[int, float]) -> int:
    """The cap (see the module docstring) from measured step times."""
    within = [cap for cap, ms in mixed_ms.items() if ms <= SLOWDOWN * decode_ms]
    if within:
        return max(within)
    return max(mixed_ms, key=lambda cap: cap / (mixed_ms[cap] - decode_ms))


def measure(runner, reps: int = 5) -> tuple[int, dict]:
    """Time decode-only and mixed steps on `runner` -> (cap, what was measured)."""
    e = runner.engine
    # NOTE: up to 32 decoding sequences (the default batch), a few slots left for the chunks
    reserve = max(1, min(4, e.max_num_seqs // 8))
    batch = min(32, e.max_num_seqs - reserve)
    room = e.max_model_len - 1
    chunk = min(e.prefill_chunk, room)  # NOTE: a context shorter than a chunk holds less
    caps = candidates(e.max_batched_tokens, batch, reserve * chunk) if batch else []
    if not caps:
        return min(SMALLEST, e.prefill_chunk), {"caps": "none fit the batch and budget"}
    decoding = [runner.allocate() for _ in range(batch)]
    filling = [runner.allocate() for _ in range(-(-caps[-1] // chunk))]
    try:
        prefix = min(_PREFIX, e.max_batched_tokens // batch, room // 2)
        runner.forward(decoding, [[_TOKEN] * prefix] * batch)
        decode_ms = _timed(runner, lambda: runner.forward(decoding, [[_TOKEN]] * batch), reps)
        mixed_ms = {}
        for cap in caps:
            def step(cap=cap) -> None:
                rows = _split(cap, chunk)
                for i, n in enumerate(rows):
                    if filling[i].num_cached + n > room:
                        runner.free(filling[i])
                        filling[i] = runner.allocate()
                runner.forward(decoding + filling[:len(rows)],
                               [[_TOKEN]] * batch + [[_TOKEN] * n for n in rows])
            mixed_ms[cap] = _timed(runner, step, reps)
    finally:
        for seq in decoding + filling:
            runner.free(seq)
    cap = choose(decode_ms, mixed_ms)
    return cap, {"batch": batch, "decode_ms": round(decode_ms, 3),
                 "mixed_ms": {c: round(ms, 3) for c, ms in mixed_ms.items()}}


def _split(rows: int, chunk: int) -> list[int]:
    return [chunk] * (rows // chunk) + [rows % chunk] * (rows % chunk > 0)


def _timed(runner, fn, reps: int) -> float:
    """The fastest of `reps` calls after one untimed call, in ms (a step's cost without the
    stalls another process or the clock may add to any one call)."""
    cuda = runner.device.type == "cuda"
    samples = []
    for i in range(reps + 1):
        if cuda:
            torch.cuda.synchronize(runner.device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(runner.device)
        if i:
            samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)
