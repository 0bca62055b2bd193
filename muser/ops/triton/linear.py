"""Projections: cuBLAS tensor-core GEMM for prefill chunks; for decode rows (N <= 8) the
fastest of the Triton GEMV configs and cuBLAS, measured once per shape on the device.

Each decode shape is timed in a CUDA graph (no launch gaps), over enough weight copies to
defeat L2, the first time it is seen (the engine's warm-up, before graph capture); the
winner is remembered for the process. MUSER_GEMV=0 routes decode rows to cuBLAS only.
Outputs are in the weight dtype (the reference rounds to it too); consumers upcast on load.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from muser.ops.triton.geglu import geglu
from muser.ops.triton.gemv import MAX_ROWS, GemvConfig, candidates, gemv

_CHOICE: dict[tuple, GemvConfig | None] = {}  # None: cuBLAS
_TIMED: dict[tuple, dict[str, float]] = {}  # shape -> {config: ms per call} (receipts)
_L2_DEFEAT_BYTES = 192 << 20


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [N, K], weight: [M, K] -> [N, M] in weight.dtype."""
    if x.shape[0] <= MAX_ROWS:
        return _decode(x, weight, False)
    return _cublas(x, weight, False)


def geglu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(geglu(gate_up), weight); a GEMV forms the GeGLU on its input load."""
    if gate_up.shape[0] <= MAX_ROWS:
        return _decode(gate_up, weight, True)
    return _cublas(gate_up, weight, True)


def decode_choices() -> dict[str, dict]:
    """Per decode shape (rows, M, K, geglu, dtypes): the config it runs and the measured ms
    of every candidate (for benchmark receipts)."""
    return {str(k): {"runs": "cublas" if c is None else str(c), "timed_ms": _TIMED.get(k, {})}
            for k, c in _CHOICE.items()}


def _cublas(x: torch.Tensor, weight: torch.Tensor, fuse_geglu: bool) -> torch.Tensor:
    if fuse_geglu:
        x = geglu(x)
    return torch.mm(x.to(weight.dtype), weight.t())


def _decode(x: torch.Tensor, weight: torch.Tensor, fuse_geglu: bool) -> torch.Tensor:
    if os.environ.get("MUSER_GEMV", "1") == "0":
        return _cublas(x, weight, fuse_geglu)
    if not x.is_cuda:  # the interpreter: one small config, nothing to time
        return gemv(x, weight, fuse_geglu)
    key = (x.shape[0], weight.shape[0], weight.shape[1], fuse_geglu, weight.dtype, x.dtype)
    if key not in _CHOICE:
        _CHOICE[key], _TIMED[key] = _pick(x, weight, fuse_geglu)
    config = _CHOICE[key]
    if config is None:
        return _cublas(x, weight, fuse_geglu)
    return gemv(x, weight, fuse_geglu, config)


def _pick(
    x: torch.Tensor, weight: torch.Tensor, fuse_geglu: bool
) -> tuple[GemvConfig | None, dict[str, float]]:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("decode GEMV shape first seen during graph capture: warm up first")
    n, m, k = x.shape[0], weight.shape[0], weight.shape[1]
    copies = [weight] + [weight.clone() for _ in range(
        min(7, math.ceil(_L2_DEFEAT_BYTES / weight.nbytes) - 1))]
    runs: dict[GemvConfig | None, Callable] = {
        None: lambda w: _cublas(x, w, fuse_geglu)}
    for c in candidates(n, m, k):
        runs[c] = lambda w, c=c: gemv(x, w, fuse_geglu, c)
    best, best_ms, timed = None, math.inf, {}
    for config, fn in runs.items():
        try:
            ms = _graph_ms(fn, copies)
        except Exception:  # noqa: BLE001  (a config that fails to compile is skipped)
            continue
        timed["cublas" if config is None else str(config)] = round(ms, 5)
        if ms < best_ms:
            best, best_ms = config, ms
    return best, timed


def _graph_ms(fn: Callable, weights: list[torch.Tensor], reps: int = 4) -> float:
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
