"""The exact route over GGUF block weights (muser/ops/triton/block_weights.py): a row's
projection has the bits of the dense exact route on the matrix dequantized to the engine's
dtype (dequantize_blocks.py's values), at every width — decode batches (up to 64 rows) through
the block GEMV's dot kind, which reads the blocks and dequantizes its tiles in registers, wider
chunks through the workspace and the GEMM with the same cuts — for every block type the
kernels read and for a matrix of row segments of several (a Q4_K_M QKV).

As in test_exact_order.py, under the interpreter a dot sums its K step at once with numpy: a
float32 tile's sum (BLAS's) follows the tile's other sizes, so in float32 the widths compared
with each other there are those whose tiles have one shape (up to 16 rows, and beyond 64),
while float16 tiles sum alike at every width. Every decode width, 64 included, is also
compared with the dense route at the same width, tile for tile."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from test_blocks import _random_blocks
from test_exact_order import _project

from muser.ops.blocks import BlockMatrix, BlockRows, cat_blocks, segments
from muser.ops.triton import block_weights, linear, order
from muser.ops.triton.dequantize_blocks import dequantize_blocks
from muser.ops.triton.gemv_blocks import linear_blocks
from muser.ops.triton.order import k_per_split
from muser.ops.triton.switches import switched
from tests.error_bounds import gamma

from opcheck import DEVICE, UNIT_ROUNDOFF, rand

QT = GGMLQuantizationType
ROWS = 96  # beyond a decode batch: the workspace and the GEMM
WIDTHS = (1, 5, 16, 33, 64, 80)
ONE_SHAPE_WIDTHS = (1, 5, 16, 80)  # float32 under the interpreter (see above)
K = 512  # two cuts of 256 for 64 weight rows: two 256-value super-blocks, 16 blocks of 32
TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q5_0)
MIXED = ((QT.Q5_0, 16), (QT.Q8_0, 8), (QT.Q4_K, 24), (QT.Q6_K, 16))  # like a Q4_K_M QKV
DTYPES = (torch.float16, torch.float32)  # the engine's (bfloat16: wrong under the interpreter)


@pytest.fixture(autouse=True)
def exact_blocks():
    """Block weights on the exact route (the `exact_blocks` switch: off by default until it
    has run on a GPU)."""
    with switched(exact_blocks=True):
        yield


def _blocks(gen, dtype, *parts: tuple[QT, int], k: int = K):
    """A [sum rows, k] matrix of random blocks in the given (type, rows) segments, fused as the
    loader fuses them (cat_blocks)."""
    mats = [BlockMatrix.from_raw(torch.from_numpy(_random_blocks(gen, q, rows, k)).to(DEVICE),
                                 q, (rows, k), dtype) for q, rows in parts]
    return cat_blocks(mats)


def _dense(w, dtype: torch.dtype) -> torch.Tensor:
    """The matrix as the workspace holds it."""
    return torch.cat([dequantize_blocks(part, dtype) for _, part in segments(w)])


def _bound(x: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x W^T in float64 over the engine-dtype values both operands are rounded to, its error
    bound). Each product is exact (16-bit operands) or rounds once (float32); a product then
    passes through at most K - 1 additions of its cut's chain (a dot's K step, then the add
    into the accumulator) and the cuts' sum, from zero: depth D = 1 + K + cuts, so
    gamma_D * sum |x w| (plus the float64 reference's own K 2^-53 of it); then the output's
    rounding to the engine dtype: u * |y|."""
    dtype = dense.dtype
    xd, wd = x.to(dtype).double(), dense.double()
    exact, mags = xd @ wd.t(), xd.abs() @ wd.abs().t()
    g = gamma(1 + K + K // k_per_split(*dense.shape)) + K * 2.0**-53
    u = UNIT_ROUNDOFF[dtype]
    return exact, g * mags * (1 + u) + u * exact.abs()


def _inputs(gen, dtype, parts):
    w = _blocks(gen, dtype, *parts)
    m = w.shape[0]
    x = rand(gen, ROWS, K, scale=1e-3)  # GeGLU's exp in range
    norm = (rand(gen, ROWS, m), rand(gen, m, scale=0.5) + 1, rand(gen, m, scale=0.5) + 1)
    return x, w, norm


# float32 for the types the mixed matrix lacks, and it
CASES = [(q.name, ((q, 64),), "plain", torch.float16) for q in TYPES] + [
    (q.name, ((q, 64),), "plain", torch.float32) for q in (QT.Q5_K, QT.Q4_0)] + [
    ("mixed", MIXED, "plain", d) for d in DTYPES] + [
    ("Q4_K", ((QT.Q4_K, 64),), "geglu", torch.float16), ("mixed", MIXED, "geglu", torch.float16),
    ("Q6_K", ((QT.Q6_K, 64),), "norm", torch.float16), ("mixed", MIXED, "norm", torch.float16)]


@pytest.mark.parametrize("parts,epilogue,dtype", [c[1:] for c in CASES],
                         ids=[f"{c[0]}-{c[2]}-{str(c[3]).removeprefix('torch.')}" for c in CASES])
def test_a_row_has_the_same_bits_at_every_width(gen, parts, epilogue, dtype):
    """Widths 1, 5, 16, 33, 64 (the block dot GEMV) and 80 (the workspace and the GEMM)
    against a 96-row chunk; 64 rows against the dense route at 64 rows on the dequantized matrix, tile
    for tile; plain projections within the bound of the float64 product."""
    x, w, norm = _inputs(gen, dtype, parts)
    assert isinstance(w, BlockRows if len(parts) > 1 else BlockMatrix)
    assert K // k_per_split(*w.shape) == 2
    wide = _project(epilogue, x, w, norm)
    every = DEVICE == "cuda" or dtype == torch.float16
    for width in WIDTHS if every else ONE_SHAPE_WIDTHS:
        for start in (0, ROWS - width):
            rows = slice(start, start + width)
            part = _project(epilogue, x[rows], w, tuple(t[rows] if t.dim() == 2 else t
                                                        for t in norm))
            assert torch.equal(part, wide[rows]), (width, start)
    dense = _dense(w, dtype)
    assert torch.equal(_project(epilogue, x[:64], w, norm), _project(epilogue, x[:64], dense,
                                                                      norm))
    if epilogue == "plain":
        assert wide.dtype == dtype
        exact, bound = _bound(x, dense)
        assert ((wide.double() - exact).abs() <= bound).all()


def test_head_tiles_are_cut_as_the_whole_matrix(gen, monkeypatch):
    """A matrix wider than the workspace (the LM head) runs in row tiles of it, each cut as
    the whole matrix: the tiled chunk has the bits of the dense route on the whole matrix
    and of a decode row. NOTE: the cut policy's program target is lowered, so that a small
    matrix (256 rows: 2 cuts of K) and its 64-row tiles (alone: 4) are cut apart."""
    monkeypatch.setattr(block_weights, "_WORKSPACE", {})
    monkeypatch.setattr(block_weights, "HEAD_TILE_ROWS", 64)
    dtype = torch.float16
    w = _blocks(gen, dtype, (QT.Q6_K, 160), (QT.Q8_0, 96), k=2 * K)  # tiles of 64 rows
    x = rand(gen, 65, 2 * K)
    with monkeypatch.context() as patch:
        patch.setattr(order, "TARGET_PROGRAMS", 8)
        k_per_split.cache_clear()
        assert k_per_split(*w.shape) == 512 and k_per_split(64, 2 * K) == 256
        workspace = block_weights.reserve(torch.device(DEVICE), dtype, 64 * 2 * K)
        tiled = linear(x, w)
        assert block_weights._WORKSPACE[(torch.device(DEVICE), dtype)] is workspace
        assert torch.equal(tiled, linear(x, _dense(w, dtype)))
        assert torch.equal(linear(x[-1:], w), tiled[-1:])
    k_per_split.cache_clear()


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0], ids=lambda q: q.name)
def test_switched_off_decode_rows_take_the_int8_gemv(gen, qtype):
    """With the exact route off, decode rows (up to 8) keep the int8 block GEMV: its bits, and
    a row's bits then move with the width (x quantized to int8 levels against the workspace's
    values in the GEMM)."""
    x, w, _ = _inputs(gen, torch.float32, ((qtype, 64),))
    with switched(exact=False):
        narrow = linear(x[:1], w)
        wide = linear(x, w)
    assert torch.equal(narrow, linear_blocks(x[:1], w).to(narrow.dtype))
    assert not torch.equal(narrow, wide[:1])
