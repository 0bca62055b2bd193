"""Projections of FP8 weights (Fp8Matrix, `--quantization fp8`), each followed by the op after
it (GeGLU, or the residual add + RMSNorm pair), routed here by `linear._project`:

- decode rows (N <= 8): the fastest of the FP8 GEMV configs (`gemv_fp8`; the op fused into
  its epilogue, or as its own kernel) and, for bfloat16 models, `scaled_mm` below, timed in
  CUDA graphs over weight copies that defeat L2;
- more rows (`fp8.chunk_route`): for bfloat16 models `scaled_mm`: x quantized per token (row)
  to e4m3 (quantize_fp8.py; not again where the kernel that wrote x quantized it too: this
  route's epilogues, add_rms_norm and GeGLU, hang their output's rows on it), then FP8 tensor
  cores (`torch._scaled_mm`, rowwise scales: scale_a [N, 1] of x, scale_b [1, M] of W), out in
  bfloat16; for other dtypes (or K, M not multiples of 16) `dequant`: W dequantized to the
  model dtype (`dequantize_fp8`), then cuBLAS on x as it is.
  Candidates are timed as `linear` times its GEMMs (in graph replay up to GRAPH_ROWS rows,
  eagerly beyond) per power-of-two bucket of rows.

Keys are `linear._key`'s. Picks timed here are written to the tuning cache beside linear.py's
(family "fp8" in `picks.py`) and loaded by the next warm-up; a shape without one is timed by
the warm-up (`STATS.tuned` counts them, and a shape tuned after it logs a warning). Inside
`launch.compile_only`, a shape without a pick compiles every candidate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import torch

from muser.ops.fp8 import Fp8Matrix, attached_rows, chunk_route, scaled_mm_fits
from muser.ops.triton.after import after
from muser.ops.triton.dequantize_fp8 import dequantize_fp8
from muser.ops.triton.geglu import geglu
from muser.ops.triton.gemv import MAX_ROWS, GemvConfig, NormEpilogue
from muser.ops.triton.gemv_fp8 import DEFAULT, candidates_fp8, gemv_fp8
from muser.ops.triton.launch import compile_only
from muser.ops.triton.linear import GRAPH_ROWS, ROUTES, _key
from muser.ops.triton.norm import add_rms_norm
from muser.ops.triton.quantize_fp8 import quantize_rows_fp8
from muser.ops.triton.timing import STATS, PickTable, eager_ms, graph_ms, rotation

Pick = GemvConfig | str  # a GEMV config (decode rows), or "scaled_mm" | "dequant"
PICKS = PickTable()  # shape key -> Pick
# NOTE: scaled_mm leaves the sums in the tensor cores' FP8 accumulator over the whole K
# (use_fast_accum), where without it the GEMM adds partial sums into float32 registers every
# few K steps (torch 2.11 serves the rowwise scaling with cuBLAS's nvjet kernels). That
# accumulator keeps fewer bits than float32 (about 14 on Hopper, as DeepSeek-V3's report
# measured), on top of the activations' e4m3 rounding (2^-4 relative per value) the FP8 route
# accepts already; what it does to the model's next-token distributions is measured by
# bench/fp8_check.py (accuracy: top-1 and KL against bfloat16, with it and without it; the
# bench sets this False for the second), its speed by bench/scaled_mm_accum.py.
FAST_ACCUM = True
choices, remember, measured = PICKS.choices, PICKS.remember, PICKS.measured


def scaled_mm(x: torch.Tensor, weight: Fp8Matrix) -> torch.Tensor:
    """x: [N, K] -> [N, M] in weight.dtype on FP8 tensor cores: x's rows quantized per token
    (`fp8.quantize_activations`, or the rows the kernel that wrote x hung on it), products of
    e4m3 codes summed in the tensor cores' accumulator (FAST_ACCUM), the two scales applied to
    each output by _scaled_mm's rowwise scaling."""
    xq = attached_rows(x)
    if xq is None:
        xq = quantize_rows_fp8(x)
    return torch._scaled_mm(xq.data, weight.data.t(), scale_a=xq.scales[:, None],
                            scale_b=weight.scales[None, :], out_dtype=weight.dtype,
                            use_fast_accum=FAST_ACCUM)


def dequant_mm(x: torch.Tensor, weight: Fp8Matrix) -> torch.Tensor:
    """x: [N, K] -> [N, M] in weight.dtype: W dequantized to weight.dtype, then torch.mm."""
    return torch.mm(x.to(weight.dtype), dequantize_fp8(weight).t())


def project(x: torch.Tensor, weight: Fp8Matrix, geglu_out: bool, norm: NormEpilogue | None):
    key = _key(x, weight, "geglu" if geglu_out else "norm" if norm is not None else "")
    pick = PICKS.pick.get(key)
    if pick is None:
        if compile_only.get():
            return _compile_candidates(x, weight, geglu_out, norm)
        pick = tune(key, x, weight, geglu_out, norm)
    return _run(x, weight, pick, geglu_out, norm)


def tune(key: tuple, x: torch.Tensor, weight: Fp8Matrix, geglu_out: bool,
         norm: NormEpilogue | None) -> Pick:
    """Choose the pick of a shape (on CUDA the fastest candidate, timed; elsewhere one small
    GEMV config or the dequant route) and remember it."""
    STATS.tuned += 1
    if STATS.serving:
        logging.getLogger("muser.tuning").warning(
            "FP8 projection %s tuned after the warm-up, on the request path", key)
    if not x.is_cuda:
        pick, timed = (DEFAULT if x.shape[0] <= MAX_ROWS else "dequant"), {}
    else:
        pick, timed = _fastest(x, weight, geglu_out, norm)
    PICKS.set(key, pick, timed)
    return pick


def _run(x: torch.Tensor, weight: Fp8Matrix, pick: Pick, geglu_out: bool,
         norm: NormEpilogue | None):
    if pick == "scaled_mm":
        y = scaled_mm(x, weight)
        # NOTE: a chunk's op after it quantizes its rows for the chunk's next FP8 projection
        # (scaled_mm too); decode rows go to GEMVs, which read them unquantized
        rows = x.shape[0] > MAX_ROWS
        if norm is not None:
            return add_rms_norm(norm.residual, y, norm.post, norm.next, norm.eps, norm.dtype,
                                fp8_rows=rows)
        return geglu(y, fp8_rows=rows) if geglu_out else y
    if pick == "dequant":
        return after(dequant_mm(x, weight), geglu_out, norm)
    if pick.fused:
        return gemv_fp8(x, weight, pick, geglu_out, norm)
    return after(gemv_fp8(x, weight, pick), geglu_out, norm)


def _candidates(x: torch.Tensor, weight: Fp8Matrix, geglu_out: bool,
                norm: NormEpilogue | None) -> list[Pick]:
    n, (m, k) = x.shape[0], weight.shape
    if n > MAX_ROWS:
        # NOTE: one route, not "dequant" beside scaled_mm: that route writes the whole weight in
        # bfloat16 on every call; timed eagerly it won only where the launches' host time
        # decided, and lost in the chunk's kernels (docs/gpu-notes.md, "The FP8 kernels")
        return [chunk_route(weight.dtype, m, k)]
    picks: list[Pick] = ["scaled_mm"] if scaled_mm_fits(weight.dtype, m, k) else []
    for c in candidates_fp8(n, m, k):
        picks += [c, dataclasses.replace(c, fused=False)] if geglu_out or norm else [c]
    return picks


def _compile_candidates(x: torch.Tensor, weight: Fp8Matrix, geglu_out: bool,
                        norm: NormEpilogue | None):
    """Inside compile_only: compile every candidate of a shape -> the output of the last one
    that ran (the dequant route's if none did)."""
    out = None
    for pick in _candidates(x, weight, geglu_out, norm):
        with contextlib.suppress(Exception):  # as in tune: a candidate that fails is skipped
            out = _run(x, weight, pick, geglu_out, norm)
    return out if out is not None else _run(x, weight, "dequant", geglu_out, norm)


def _fastest(x: torch.Tensor, weight: Fp8Matrix, geglu_out: bool,
             norm: NormEpilogue | None) -> tuple[Pick, dict[str, float]]:
    """Each candidate timed as the shape runs: in graph replay up to GRAPH_ROWS rows (decode
    batches replay CUDA graphs), eagerly beyond (prefill launches eagerly); a lone candidate
    (a chunk's route) is taken untimed."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("FP8 projection shape first seen during graph capture: warm up first")
    candidates = _candidates(x, weight, geglu_out, norm)
    if len(candidates) == 1:
        return candidates[0], {}
    copies = rotation(weight, weight.nbytes(),
                      lambda w: Fp8Matrix(w.data.clone(), w.scales.clone(), w.dtype))
    timer = graph_ms if x.shape[0] <= GRAPH_ROWS else eager_ms
    best, best_ms, timed = None, math.inf, {}
    for pick in candidates:
        try:
            ms = timer(lambda w, p=pick: _run(x, w, p, geglu_out, norm), copies)
        except Exception:  # noqa: BLE001, S112  (a candidate that fails is skipped)
            continue
        timed[str(pick)] = round(ms, 5)
        if ms < best_ms:
            best, best_ms = pick, ms
    if best is None:
        raise RuntimeError(f"no FP8 projection candidate ran for {x.shape[0]} x {weight.shape}")
    return best, timed


ROUTES[Fp8Matrix] = project
