"""GGUF block matrices (muser.ops.blocks) as the Triton backend reads them: projections, the
embedding lookup and the prefill workspace. Weights stay the file's bytes on the device.

On the exact route for blocks (the `exact_blocks` switch, with `exact` and `gemv`; off by
default until a GPU run has shown it bitwise and measured its decode; docs/exactness.md) every
width gives the bits of the dense exact route on W dequantized to the engine's dtype as
dequantize_blocks.py rounds it (order.py's cuts of the whole matrix, tensor-core dot chains):
- decode rows (N <= DOT_ROWS, 64): the block GEMV's dot kind (gemv_blocks_dot.py) reads the
  blocks and dequantizes its tiles in registers; a matrix of row segments of several types (a
  Q4_K_M QKV) reads each into its columns of one output, every segment cut as the whole
  matrix; GeGLU in the epilogue (one block type) or as its own kernel, the residual add +
  RMSNorm as its own row kernel, as the dense exact route runs them;
- more rows: the workspace below, then linear.py's exact GEMM with the same cuts; the head's
  row tiles are cut as the whole head (`rows`).
Every type the kernels read (KERNEL_TYPES) and every shape is on it: a cut is a multiple of
256 columns, so it begins on a block.

Off it (the default for now):
- decode rows (N <= 8): the int8 block GEMV (gemv_blocks.py) reads a matrix of one block type
  in place, GeGLU or the residual add + RMSNorm in its epilogue (gemv.py's); a matrix of row
  segments reads each into its columns of one output in the engine's dtype (x quantized
  once, int8_rows.py, for every segment), and an epilogue then runs as its own kernel;
- more rows (prefill chunks, decode batches of more than 8): the matrix is dequantized into
  one reused workspace in the engine's dtype (dequantize_blocks.py, gguf's values rounded
  once), then the dense projection runs on it (linear.py: its tuned GEMM or cuBLAS, epilogue
  included); a matrix larger than the workspace (the tied LM head, vocab rows) runs in row
  tiles of it, each projected into its columns of the output.
The embedding: the rows asked for are gathered as blocks and dequantized (float32).

A block GEMV's config is chosen per shape (int8: rows, M, K, block type, x dtype; dot: rows
past 8 by power-of-two bucket as linear.py keys them, also the engine dtype and the cut): a pick from the tuning cache (families "blocks" and
"blocks_exact" in `picks.py`, written after a warm-up that timed any), else on CUDA the
fastest of the candidates (`candidates_blocks`, `candidates_dot`), timed in CUDA graphs over
copies of the blocks that defeat L2 (as linear.py times its GEMVs; the warm-up's decode shapes
are timed there, and one first seen after it logs a warning); elsewhere a default. The block
GEMVs have no cuBLAS twin: the `gemv` switch off reaches the dense route only.

`prepare_weights` reserves the workspace before the warm-up: as many elements as the largest
block matrix of the layers (at least HEAD_TILE_ROWS head rows), one buffer per device and dtype
for every matrix, so the decode graphs capture no allocation of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial

import torch

from muser.ops.blocks import BlockMatrix, Blocks, block_tensors, segments
from muser.ops.fp8 import Fp8Matrix
from muser.ops.ref import Weights, fed
from muser.ops.triton.after import after
from muser.ops.triton.alloc import empty
from muser.ops.triton.dequantize_blocks import dequantize_blocks
from muser.ops.triton.embed import embed_rows
from muser.ops.triton.gemv import DOT_ROWS, GemvConfig, NormEpilogue
from muser.ops.triton.gemv_blocks import (
    MAX_ROWS,
    BlockGemvConfig,
    candidates_blocks,
    default_config,
    linear_blocks,
)
from muser.ops.triton.gemv_blocks_dot import candidates_dot, linear_blocks_dot
from muser.ops.triton.int8_rows import int8_rows
from muser.ops.triton.launch import compile_only, next_power_of_2
from muser.ops.triton.order import k_per_split
from muser.ops.triton.switches import current as switches_in_force
from muser.ops.triton.timing import STATS, PickTable, graph_ms, rotation

HEAD_TILE_ROWS = 4096  # the fewest head rows one workspace tile holds
_WORKSPACE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
PICKS = PickTable()  # (rows, M, K, block type, x dtype) -> BlockGemvConfig
# the exact route's: (rows or bucket, M, K, block type, x dtype, engine dtype, cut) -> GemvConfig
# ("dot")
EXACT_PICKS = PickTable()
choices, remember, measured = PICKS.choices, PICKS.remember, PICKS.measured
Dense = Callable[..., object]  # linear._project: (x, w, geglu_out, norm, rows=None)


def prepare_weights(weights: Weights) -> Weights:
    """The weights as given, the prefill workspace reserved when any matrix is blocks."""
    mats = [m for layer in weights.layers for m in (layer.qkv, layer.o_proj, layer.gate_up,
                                                    layer.down) if isinstance(m, Blocks)]
    sizes = [m.shape[0] * m.shape[1] for m in mats]
    if isinstance(head := weights.head, Blocks):
        mats.append(head)
        sizes.append(min(head.shape[0], HEAD_TILE_ROWS) * head.shape[1])
    if mats:
        reserve(mats[0].device, mats[0].dtype, max(sizes))
    return weights


def reserve(device: torch.device, dtype: torch.dtype, size: int) -> torch.Tensor:
    """The workspace of `device` and `dtype`, (re)allocated to hold at least `size` elements
    (only calls before the warm-up allocate: prepare_weights reserves the most any call asks)."""
    key = (torch.device(device), dtype)
    if key not in _WORKSPACE or _WORKSPACE[key].numel() < size:
        _WORKSPACE.pop(key, None)
        _WORKSPACE[key] = torch.empty(size, dtype=dtype, device=device)
    return _WORKSPACE[key]


def embed(table: torch.Tensor | Fp8Matrix | Blocks, ids: torch.Tensor, scale: float = 1.0,
          feed: torch.Tensor | None = None) -> torch.Tensor:
    """ref.embed on the device: a dense or FP8 table in one launch (embed.py); blocks: only the
    rows asked for are gathered as blocks and dequantized (float32)."""
    if not isinstance(table, BlockMatrix):
        return embed_rows(table, ids, scale, feed)
    rows = dequantize_blocks(table.take(fed(ids, feed)), torch.float32)
    return rows if scale == 1.0 else rows * scale


def project(x: torch.Tensor, weight: Blocks, geglu_out: bool, norm: NormEpilogue | None,
            dense: Dense):
    """linear.py's projection (with GeGLU or the add + norm pair after it) of a block matrix;
    `dense(x, w, geglu_out, norm, rows=None)` projects by a dense matrix (linear.py's tuned
    path; rows: the whole matrix's, where w is a row tile of it)."""
    switches = switches_in_force()
    if switches.exact and switches.gemv and switches.exact_blocks:
        if x.shape[0] <= DOT_ROWS:
            return _project_dot(x, weight, geglu_out, norm)
    elif x.shape[0] <= MAX_ROWS:
        return _project_int8(x, weight, geglu_out, norm)
    return _project_workspace(x, weight, geglu_out, norm, dense)


def _project_dot(x: torch.Tensor, weight: Blocks, geglu_out: bool, norm: NormEpilogue | None):
    """The exact route's decode rows: the block GEMV's dot kind (gemv_blocks_dot.py), every
    segment cut as the whole matrix; GeGLU in its epilogue (one block type) or as its own kernel,
    the norm pair as its own row kernel (as linear.py's exact route runs them)."""
    n, (m, k) = x.shape[0], weight.shape
    cut = k_per_split(m, k)
    if isinstance(weight, BlockMatrix) and norm is None:
        run = partial(linear_blocks_dot, x, cut=cut, geglu=geglu_out)
        return run(weight, gemv_config(x, weight, run, cut))
    y = empty((n, m), weight.dtype, x.device)
    for row, part in segments(weight):
        run = partial(linear_blocks_dot, x, cut=cut, out=y[:, row:row + part.shape[0]])
        run(part, gemv_config(x, part, run, cut))
    return after(y, geglu_out, norm)


def _project_int8(x: torch.Tensor, weight: Blocks, geglu_out: bool, norm: NormEpilogue | None):
    """Decode rows off the exact route: the int8 block GEMV (gemv_blocks.py)."""
    n, m = x.shape[0], weight.shape[0]
    if isinstance(weight, BlockMatrix):  # the epilogue in the GEMV
        out = None if geglu_out or norm is not None else empty((n, m), weight.dtype, x.device)
        run = partial(linear_blocks, x, out=out, geglu=geglu_out, norm=norm)
        return run(weight, gemv_config(x, weight, run))
    y = empty((n, m), weight.dtype, x.device)
    rows = int8_rows(x)  # x quantized once for every segment
    for row, part in segments(weight):
        run = partial(linear_blocks, x, out=y[:, row:row + part.shape[0]], rows=rows)
        run(part, gemv_config(x, part, run))
    return after(y, geglu_out, norm)


def _project_workspace(x: torch.Tensor, weight: Blocks, geglu_out: bool,
                       norm: NormEpilogue | None, dense: Dense):
    """The matrix dequantized into the workspace, then the dense projection; a matrix larger
    than it in row tiles, each cut as the whole matrix (`rows`)."""
    n, (m, k) = x.shape[0], weight.shape
    # NOTE: a no-op after prepare_weights; ops called without it (tests) size it here. Only a
    # plain projection (the head) may run in tiles: an epilogue needs every column at once.
    rows = m if geglu_out or norm is not None else min(m, HEAD_TILE_ROWS)
    workspace = reserve(x.device, weight.dtype, rows * k)
    tile = workspace.numel() // k
    if m <= tile:
        return dense(x, _dequantize(weight, 0, m, workspace), geglu_out, norm)
    out = empty((n, m), weight.dtype, x.device)
    for start in range(0, m, tile):
        stop = min(m, start + tile)
        out[:, start:stop] = dense(x, _dequantize(weight, start, stop, workspace), False, None,
                                   rows=m)
    return out


def _dequantize(weight: Blocks, start: int, stop: int, workspace: torch.Tensor) -> torch.Tensor:
    """Rows start .. stop - 1 of `weight` dequantized into the head of `workspace` -> the
    [stop - start, K] view of them."""
    dense = workspace[:(stop - start) * weight.shape[1]].view(stop - start, weight.shape[1])
    for row, part in segments(weight, start, stop):
        dequantize_blocks(part, dense.dtype, out=dense[row - start:row - start + part.shape[0]])
    return dense


def gemv_config(x: torch.Tensor, part: BlockMatrix, run: Callable, cut: int | None = None
                ) -> BlockGemvConfig | GemvConfig:
    """The block GEMV config of this shape: chosen once (see the module docstring), timing
    `run(weight, config)` (the launch as the caller makes it); with `cut`, of the exact route's
    dot kind cut there (its picks apart: EXACT_PICKS). Inside compile_only, a shape without a
    pick compiles every candidate and runs the default."""
    n, (m, k) = x.shape[0], part.shape
    if cut is None:
        table, key = PICKS, (n, m, k, part.qtype, x.dtype)
        configs = candidates_blocks(n, m, k, part.qtype)
        default = default_config(n, m, k, part.qtype)
    else:
        # NOTE: rows keyed as linear._key keys them (exact up to 8, then power-of-two buckets,
        # whose widest the warm-up runs)
        rows = n if n <= MAX_ROWS else next_power_of_2(n)
        table, key = EXACT_PICKS, (rows, m, k, part.qtype, x.dtype, part.dtype, cut)
        configs = candidates_dot(n, m, k, cut)
        default = configs[0] if x.is_cuda else configs[-1]  # the last: the interpreter's
    pick = table.pick.get(key)
    if pick is not None:
        return pick
    if not x.is_cuda:
        table.set(key, default, {})
        return default
    if compile_only.get():
        for c in configs:
            run(part, c)
        return default
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("block GEMV shape first seen during graph capture: warm up first")
    STATS.tuned += 1
    if STATS.serving:
        logging.getLogger("muser.tuning").warning(
            "block GEMV %s tuned after the warm-up, on the request path", key)
    copies = rotation(part, sum(t.nbytes for t in block_tensors(part)), BlockMatrix.clone)
    best, best_ms, timed = default, math.inf, {}
    for c in configs:
        try:
            ms = graph_ms(lambda w, c=c: run(w, c), copies)
        except Exception:  # noqa: BLE001, S112  (a config that fails is skipped)
            continue
        timed[str(c)] = round(ms, 5)
        if ms < best_ms:
            best, best_ms = c, ms
    table.set(key, best, timed)
    return best
