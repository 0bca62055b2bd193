"""CUDA-event timing for the bench scripts that time one call at a time (gpu_bench.py,
decode_depth.py, prefill_depth.py): the median of calls timed one by one, and the device
copy's bandwidth, the floor's denominator."""

from __future__ import annotations

import statistics

import torch


def bench_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of fn() with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(nbytes: int) -> float:
    """Bytes a second (read + write) of a device-to-device copy of nbytes, median of 10."""
    x = torch.empty(nbytes, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    return 2 * nbytes / (bench_ms(lambda: y.copy_(x), reps=10) / 1e3)
