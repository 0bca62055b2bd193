"""The exact route's order property (muser/ops/triton/order.py): a row's projection has the
same bits at every width — decode batches (up to 64 rows) through the tensor-core GEMV cut over
K, wider chunks through the GEMM with the same cuts in registers, the norm pair as its own row
kernel after either.

Under the interpreter a dot sums its K step at once, with numpy, whose sum also follows the
tile's other sizes; so there these tests hold the order of the cuts and of their sums (the part
of the route that is muser's) at widths whose tiles have one shape: up to 16 rows (the GEMV's
16-row tile) and beyond 64 (the GEMM's). On a GPU they run at every width; that the tensor cores
sum a chain alike whatever the tile is measured by bench/exact_probe.py."""

from __future__ import annotations

import pytest
import torch

from muser.ops.triton import linear, linear_add_rms_norm, linear_geglu
from muser.ops.triton.gemm import SMALL, gemm
from muser.ops.triton.gemv import GemvConfig, gemv
from muser.ops.triton.order import k_per_split
from muser.ops.triton.switches import switched

from opcheck import DEVICE, rand

ROWS = 96  # beyond a decode batch: the GEMM
WIDTHS = (1, 5, 16, 80) + ((33, 64) if DEVICE == "cuda" else ())
K = 1024  # four cuts of 256 for 64 weight rows


def _project(epilogue: str, x, w, norm):
    if epilogue == "plain":
        return linear(x, w)
    if epilogue == "geglu":
        return linear_geglu(x, w)
    res, post, nxt = norm
    return torch.cat(linear_add_rms_norm(x, w, res[: x.shape[0]], post, nxt, 1e-6, w.dtype), 1)


def _inputs(gen, dtype, epilogue):
    m = 64
    x = rand(gen, ROWS, K)
    w = rand(gen, m, K, dtype=dtype, scale=0.05)
    norm = (rand(gen, ROWS, m), rand(gen, m, scale=0.5) + 1, rand(gen, m, scale=0.5) + 1)
    return x, w, norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("epilogue", ["plain", "geglu", "norm"])
def test_a_row_has_the_same_bits_at_every_width(gen, dtype, epilogue):
    x, w, norm = _inputs(gen, dtype, epilogue)
    assert K // k_per_split(*w.shape) == 4
    wide = _project(epilogue, x, w, norm)
    for width in WIDTHS:
        for start in (0, ROWS - width):
            rows = slice(start, start + width)
            part = _project(epilogue, x[rows], w, tuple(t[rows] if t.dim() == 2 else t
                                                        for t in norm))
            assert torch.equal(part, wide[rows]), (width, start)


def test_the_inexact_route_differs_across_widths(gen):
    """The check above can fail: with the exact route off, the widths sum in other orders (the
    one-row FMA GEMV, the library GEMM beyond eight rows) and some row's bits move."""
    x, w, _ = _inputs(gen, torch.float32, "plain")
    with switched(exact=False):
        wide = linear(x, w)
        narrow = torch.cat([linear(x[i:i + 1], w) for i in range(8)])
    assert not torch.equal(narrow, wide[:8])


@pytest.mark.parametrize("cut", [32, 64, 96])
def test_gemv_cuts_and_gemm_cuts_sum_alike(gen, cut):
    """The two kernels given the same cut directly, K not a multiple of it (a short last
    cut), every decode width against a 24-row chunk."""
    k = 200
    x, w = rand(gen, 24, k), rand(gen, 48, k, dtype=torch.float16, scale=0.1)
    wide = gemm(x, w, SMALL, k_per_split=cut)
    for n in range(1, 9):
        narrow = gemv(x[:n], w, GemvConfig("dot", 32, 32, 1, 4, 2), k_per_split=cut)
        assert torch.equal(narrow, wide[:n]), n
