"""Timing of kernel candidates on CUDA, shared by the projections that choose configs per
shape (linear.py, linear_fp8.py, block_weights.py): the tables of their picks, the timers, and
the process's tuning counters."""

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


class PickTable:
    """One projection route's picks per shape key: what runs (`pick`), every candidate's
    measured ms (`timed`, for receipts) and where the pick came from (`source`: "timed" in this
    process, or "cache" / "shipped" when remembered from a tuning table)."""

    def __init__(self) -> None:
        self.pick: dict[tuple, object] = {}
        self.timed: dict[tuple, dict[str, float]] = {}
        self.source: dict[tuple, str] = {}

    def set(self, key: tuple, pick, timed: dict[str, float], source: str = "timed") -> None:
        self.pick[key], self.timed[key], self.source[key] = pick, timed, source

    def choices(self, show: Callable = str) -> dict[str, dict]:
        """Per shape: the pick it runs (as `show` writes it), the measured ms of every
        candidate and the pick's source (benchmark receipts)."""
        return {str(k): {"runs": show(p), "timed_ms": self.timed.get(k, {}),
                         "source": self.source.get(k, "timed")} for k, p in self.pick.items()}

    def remember(self, picks: dict[tuple, tuple[object, dict]], source: str) -> int:
        """Take stored picks for shapes not chosen yet -> how many were taken."""
        fresh = {k: v for k, v in picks.items() if k not in self.pick}
        for key, (pick, timed) in fresh.items():
            self.set(key, pick, timed, source)
        return len(fresh)

    def measured(self) -> dict[tuple, tuple[object, dict]]:
        """Picks timed on CUDA in this process (what the tuning cache stores)."""
        return {k: (self.pick[k], self.timed[k]) for k, s in self.source.items()
                if s == "timed" and self.timed[k]}


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
