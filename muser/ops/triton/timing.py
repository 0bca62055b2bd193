"""Timing of kernel candidates on CUDA, shared by the projections that choose configs per
shape (linear.py, linear_fp8.py, block_weights.py), and the process's tuning counters."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

L2_DEFEAT_BYTES = 192 << 20  # weights timed in rotation over at least this many bytes


@dataclass(slots=True)
class TuningStats:
    tuned: int = 0  # calls of `tune`: shapes chosen in this process (timed on CUDA)
    serving: bool = False  # set once the warm-up is over: a shape tuned after it is a stall


STATS = TuningStats()


def rotation(weight, nbytes: int, clone: Callable) -> list:
    """weight and enough copies of it (clone(weight), at most 7) to defeat L2 when timed in
    rotation; nbytes: its size."""
    count = min(7, math.ceil(L2_DEFEAT_BYTES / nbytes) - 1)
    return [weight] + [clone(weight) for _ in range(count)]


def graph_ms(fn: Callable, weights: list[torch.Tensor], reps: int = 4) -> float:
    """Milliseconds per call of fn(w), replayed from a CUDA graph over rotating weights."""
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for w in weights:
                fn(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * reps * len(weights))


def eager_ms(fn: Callable, weights: list[torch.Tensor], reps: int = 8) -> float:
    """Milliseconds per call of fn(w) launched eagerly, back to back, over rotating weights
    (the best of three runs): the host's work per call counts as well as the GPU's."""
    fn(weights[0])
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(reps):
            fn(weights[i % len(weights)])
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3
