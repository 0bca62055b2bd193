"""Projections, each followed by the op after it (GeGLU, or the residual add + RMSNorm pair)
where the caller asks:

- decode rows (N <= 8): the fastest of the Triton GEMV configs (op fused into the epilogue, or
  as its own kernel) and cuBLAS, each timed in a CUDA graph (no launch gaps, as decode
  replays), over enough weight copies to defeat L2;
- prefill chunks: the fastest of the Triton GEMM configs (op fused into the epilogue) and a
  cuBLAS tensor-core GEMM followed by the op's own kernel, each timed eagerly, back to back
  (prefill runs eagerly: at a small model's chunk widths the host's launch work decides), per
  power-of-two bucket of rows.

The exact route (the `exact` switch, on by default; docs/exactness.md) sums every output
element in one order at every width (order.py): the tensor-core GEMV (`dot`) cut over K at the
weight's fixed offsets up to DOT_ROWS rows (a decode batch), the GEMM with the same cuts in
registers for wider chunks, the norm pair as its own row kernel after either; no cuBLAS, whose
order depends on the shape. Its picks are keyed apart (epilogue "exact", "exact+geglu",
"exact+norm") and choose tiles only. With the `exact_fp8` switch, FP8 weights (Fp8Matrix) take it
too: their codes are read as bytes, decoded to 16-bit values of the model's dtype in registers
(exactly) and multiplied by the same kernels, each cut's sums scaled by the weight rows' scales
(W8A16). Without it (the default until a GPU run shows it bitwise) they keep linear_fp8.py's
FP8 tensor-core route, whose sums depend on the width.

A shape's pick comes from the tuning cache or the shipped table (`picks.py`, loaded by the
warm-up), or `tune` times it the first time the shape is seen; the runner's warm-up
(`muser/startup/`) sees every shape serving can run before the engine reports ready, so `tune`
is never reached on the request path (`STATS.tuned` counts its calls). Inside
`launch.compile_only`, a shape without a pick compiles every candidate and runs none.
The `gemv` switch off (switches.py) routes every projection to cuBLAS. Outputs are in the
weight dtype (the reference rounds to it too); consumers upcast on load. A weight kept as GGUF
blocks takes the block route (muser/ops/triton/block_weights.py), which ends here for its dense
rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable

import torch

from muser.ops.blocks import Blocks
from muser.ops.fp8 import Fp8Matrix
from muser.ops.triton.after import after
from muser.ops.triton.block_weights import project as project_blocks
from muser.ops.triton.gemm import CANDIDATES as GEMM_CANDIDATES
from muser.ops.triton.gemm import SMALL as SMALL_GEMM
from muser.ops.triton.gemm import GemmConfig, gemm
from muser.ops.triton.gemv import (
    DEFAULT,
    DOT_ROWS,
    MAX_ROWS,
    GemvConfig,
    NormEpilogue,
    candidates,
    gemv,
)
from muser.ops.triton.launch import cdiv, compile_only, next_power_of_2
from muser.ops.triton.order import k_per_split
from muser.ops.triton.pdl import enabled as pdl_enabled
from muser.ops.triton.switches import current as switches_in_force
from muser.ops.triton.timing import STATS, PickTable, eager_ms, graph_ms, rotation

PICKS = PickTable()  # shape key -> GemvConfig | GemmConfig | None (cuBLAS)
remember, measured = PICKS.remember, PICKS.measured
_UNSET = object()
CUBLAS_MARGIN = 1.10
GRAPH_ROWS = 64  # decode batches of up to this many rows replay CUDA graphs
# weight type -> the projection of weights that are not plain tensors (linear_fp8.py adds
# Fp8Matrix's when the package is imported; the `gemv` switch does not apply to them)
ROUTES: dict[type, Callable] = {}


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [N, K], weight: [M, K] -> [N, M] in weight.dtype."""
    return _project(x, weight, False, None)


def linear_geglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """geglu(linear(x, weight)): the MLP's gate_up projection and activation -> [N, M / 2]."""
    return _project(x, weight, True, None)


def linear_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
    next_weight: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(residual, linear(x, weight), post_weight, next_weight, eps, dtype)."""
    return _project(x, weight, False, NormEpilogue(residual, post_weight, next_weight, eps, dtype))


def width_inexact(matrices: list) -> str | None:
    """Why a row's bits may depend on how many rows its step runs, for these projections'
    weights (None: they do not; docs/exactness.md)."""
    switches = switches_in_force()
    if not switches.exact:
        return "the exact route is switched off"
    if not switches.exact_fp8 and any(isinstance(m, Fp8Matrix) for m in matrices):
        return ("FP8 weights keep their FP8 tensor-core route, whose sums follow the width "
                "(their exact route has not yet been measured bitwise on a GPU)")
    if not switches.exact_blocks and any(isinstance(m, Blocks) for m in matrices):
        return ("GGUF block weights keep their int8 decode route, whose sums follow the width "
                "(their exact route has not yet run on a GPU; --gguf-weights dequantize holds "
                "them in the model's dtype, which is exact)")
    return None


def choices() -> dict[str, dict]:
    """Per shape (decode rows or prefill bucket, M, K, epilogue, dtypes): the config it runs
    and the measured ms of every candidate (for benchmark receipts)."""
    return PICKS.choices(lambda c: "cublas" if c is None else str(c))


def _cublas(x: torch.Tensor, weight: torch.Tensor, geglu_out: bool,
            norm: NormEpilogue | None):
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    return after(torch.mm(x, weight.t()), geglu_out, norm)


def _run(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | GemmConfig | None,
         geglu_out: bool, norm: NormEpilogue | None, exact: bool = False,
         fp8: Fp8Matrix | None = None, rows: int | None = None):
    """fp8: `weight` is its codes (the exact route's FP8 projection: its scales and dtype).
    rows: where weight is a row tile of a larger matrix (block_weights.py's LM head), that
    matrix's rows: the exact route cuts K as for the whole matrix (order.py)."""
    if config is None:
        return _cublas(x, weight, geglu_out, norm)
    cut = k_per_split(rows or weight.shape[0], weight.shape[1]) if exact else None
    scaled = {} if fp8 is None else {"scales": fp8.scales, "dtype": fp8.dtype}
    if isinstance(config, GemmConfig):
        if exact:  # NOTE: the norm pair as its own row kernel, as after the decode GEMV
            return after(gemm(x, weight, config, geglu_out, None, cut, **scaled), False, norm)
        return gemm(x, weight, config, geglu_out, norm)
    if config.fused and not (exact and norm is not None):
        return gemv(x, weight, config, geglu_out, norm, cut, **scaled)
    return after(gemv(x, weight, config, k_per_split=cut, **scaled), geglu_out, norm)


def _project(x: torch.Tensor, weight: torch.Tensor, geglu_out: bool,
             norm: NormEpilogue | None, rows: int | None = None):
    if isinstance(weight, Blocks):
        return project_blocks(x, weight, geglu_out, norm, _project)
    switches = switches_in_force()
    fp8 = weight if (isinstance(weight, Fp8Matrix) and switches.exact
                     and switches.exact_fp8) else None
    route = None if fp8 is not None else ROUTES.get(type(weight))
    if route is not None:
        return route(x, weight, geglu_out, norm)
    if fp8 is not None:  # the exact route: its codes through the dense kernels, scaled
        weight = fp8.data
    elif not switches.gemv:
        return _cublas(x, weight, geglu_out, norm)
    epilogue = "geglu" if geglu_out else "norm" if norm is not None else ""
    if switches.exact:
        epilogue = f"exact+{epilogue}" if epilogue else "exact"
    key = _key(x, weight, epilogue)
    config = PICKS.pick.get(key, _UNSET)
    if config is _UNSET:
        if compile_only.get():
            return _compile_candidates(x, weight, geglu_out, norm, switches.exact, fp8, rows)
        config = tune(key, x, weight, geglu_out, norm, fp8)
    return _run(x, weight, config, geglu_out, norm, switches.exact, fp8, rows)



def tune(key: tuple, x: torch.Tensor, weight: torch.Tensor, geglu_out: bool,
         norm: NormEpilogue | None, fp8: Fp8Matrix | None = None
         ) -> GemvConfig | GemmConfig | None:
    """The tuning entry point: choose the config of a shape without a pick (on CUDA, the
    fastest candidate, timed; under the interpreter, one small config) and remember it."""
    STATS.tuned += 1
    if STATS.serving:
        logging.getLogger("muser.tuning").warning(
            "projection %s tuned after the warm-up, on the request path", key)
    exact = key[3].startswith("exact")
    if not x.is_cuda:
        if exact:
            config = _exact_candidates(x.shape[0], *weight.shape, False, False)[-1]
        else:
            config = DEFAULT if x.shape[0] <= MAX_ROWS else None
        timed = {}
    else:
        pick = _pick if x.shape[0] <= (DOT_ROWS if exact else MAX_ROWS) else _pick_gemm
        config, timed = pick(x, weight, geglu_out, norm, exact, fp8)
    PICKS.set(key, config, timed)
    return config


def _candidates(x: torch.Tensor, weight: torch.Tensor, geglu_out: bool,
                norm: NormEpilogue | None, exact: bool = False
                ) -> list[GemvConfig | GemmConfig | None]:
    """Every config `tune` times for this shape, cuBLAS (None) first (not on the exact
    route)."""
    n, m, k = x.shape[0], weight.shape[0], weight.shape[1]
    if exact:
        return _exact_candidates(n, m, k, geglu_out, norm is not None, weight.element_size())
    if n > MAX_ROWS:
        return [None, *GEMM_CANDIDATES]
    configs: list[GemvConfig | GemmConfig | None] = [None]
    for c in candidates(n, m, k):
        configs += [c, dataclasses.replace(c, fused=False)] if geglu_out or norm else [c]
    return configs


# tensor-core GEMV tiles of the exact route: (weight rows, K step), each K step dividing the cut;
# the last is the interpreter's, with SMALL_GEMM's K step (the interpreter sums a dot's K step
# at once, the GPU 16 products a step whatever the tile)
EXACT_GEMV_TILES = ((64, 256), (128, 128), (64, 128), (32, 32))
FP8_GEMV_TILES = ((128, 256),)  # one-byte codes: a tile twice as wide in the same shared memory


def _exact_candidates(n: int, m: int, k: int, geglu_out: bool, norm: bool, size: int = 2
                      ) -> list[GemvConfig | GemmConfig]:
    """The exact route's configs for a shape: tiles over the weight's one cut (order.py),
    the tensor-core GEMV (a program per cut) up to a CUDA graph's DOT_ROWS decode rows; the
    last is the interpreter's (small tiles). size: bytes per weight value (1: FP8 codes)."""
    if n > DOT_ROWS:
        return [*GEMM_CANDIDATES, SMALL_GEMM]
    cuts = cdiv(k, k_per_split(m, k))
    configs = []
    for bm, bk in (FP8_GEMV_TILES if size == 1 else ()) + EXACT_GEMV_TILES:
        c = GemvConfig("dot", bm, bk, cuts, 4, 4 if bm > 32 else 2, fused=not norm)
        configs += [c, dataclasses.replace(c, fused=False)] if geglu_out else [c]
    return configs


def _compile_candidates(x: torch.Tensor, weight: torch.Tensor, geglu_out: bool,
                        norm: NormEpilogue | None, exact: bool = False,
                        fp8: Fp8Matrix | None = None, rows: int | None = None):
    """Inside compile_only: compile every candidate of a shape -> an output of its shape."""
    configs = _candidates(x, weight, geglu_out, norm, exact)
    for config in configs[:-1] if exact else configs[1:]:
        with contextlib.suppress(Exception):  # as in tune: a config that fails is skipped
            _run(x, weight, config, geglu_out, norm, exact, fp8, rows)
    return _run(x, weight, configs[-1] if exact else None, geglu_out, norm, exact, fp8, rows)


def _key(x: torch.Tensor, weight: torch.Tensor, epilogue: str) -> tuple:
    """A shape's key in the choices: decode rows (<= 8) or the power-of-two bucket of prefill
    rows (> 8), M, K, epilogue, dtypes. (Chosen once under the launch mode of the first call:
    a benchmark comparing launch modes keeps the configs.)"""
    n = x.shape[0]
    rows = n if n <= MAX_ROWS else next_power_of_2(n)
    return rows, weight.shape[0], weight.shape[1], epilogue, weight.dtype, x.dtype


def _pick(
    x: torch.Tensor, weight: torch.Tensor, geglu_out: bool, norm: NormEpilogue | None,
    exact: bool = False, fp8: Fp8Matrix | None = None,
) -> tuple[GemvConfig | None, dict[str, float]]:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("decode GEMV shape first seen during graph capture: warm up first")
    copies = rotation(weight, weight.nbytes, torch.Tensor.clone)
    runs: dict[GemvConfig | None, Callable] = {
        c: lambda w, c=c: _run(x, w, c, geglu_out, norm, exact, fp8)
        for c in _candidates(x, weight, geglu_out, norm, exact)}
    # NOTE: with programmatic dependent launch a Triton GEMV starts while its predecessor
    # drains; a cuBLAS call waits for its predecessor to finish, and makes its successor wait
    # too. Timed back to back against itself, cuBLAS does not pay for that, so it must win by
    # CUBLAS_MARGIN to be picked.
    margin = CUBLAS_MARGIN if pdl_enabled(x.device) else 1.0
    best, best_score, timed = None, math.inf, {}
    for config, fn in runs.items():
        try:
            ms = graph_ms(fn, copies)
        except Exception:  # noqa: BLE001, S112  (a config that fails to compile is skipped)
            continue
        timed["cublas" if config is None else str(config)] = round(ms, 5)
        score = ms * margin if config is None else ms
        if score < best_score:
            best, best_score = config, score
    return best, timed


def _pick_gemm(
    x: torch.Tensor, weight: torch.Tensor, geglu_out: bool, norm: NormEpilogue | None,
    exact: bool = False, fp8: Fp8Matrix | None = None,
) -> tuple[GemmConfig | None, dict[str, float]]:
    """Timed as the shape runs: in graph replay up to GRAPH_ROWS rows (decode batches replay
    CUDA graphs), eagerly beyond (prefill and mixed steps launch eagerly)."""
    copies = rotation(weight, weight.nbytes, torch.Tensor.clone)
    best, best_ms, timed = None, math.inf, {}
    timer = graph_ms if x.shape[0] <= GRAPH_ROWS else eager_ms
    for config in _candidates(x, weight, geglu_out, norm, exact):
        try:
            ms = timer(lambda w, c=config: _run(x, w, c, geglu_out, norm, exact, fp8), copies)
        except Exception:  # noqa: BLE001, S112  (a config that fails to compile is skipped)
            continue
        timed["cublas" if config is None else str(config)] = round(ms, 5)
        if ms < best_ms:
            best, best_ms = config, ms
    return best, timed


