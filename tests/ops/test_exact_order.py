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
import triton
import triton.language as tl

from muser.ops.fp8 import quantize_fp8
from muser.ops.triton import linear, linear_add_rms_norm, linear_geglu
from muser.ops.triton.gemm import SMALL, gemm
from muser.ops.triton.gemv import GemvConfig, e4m3_values, gemv
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "fp8"])
@pytest.mark.parametrize("epilogue", ["plain", "geglu", "norm"])
def test_a_row_has_the_same_bits_at_every_width(gen, dtype, epilogue):
    """fp8: FP8 codes on their exact route (their values in fp16, the rows' scales applied as
    each cut's sums are added)."""
    fp8 = dtype == "fp8"
    x, w, norm = _inputs(gen, torch.float16 if fp8 else dtype, epilogue)
    assert K // k_per_split(*w.shape) == 4
    if fp8:
        w = _fp8(gen, 64, K)
    with switched(exact_fp8=fp8):
        _check_widths(epilogue, x, w, norm)


def _check_widths(epilogue, x, w, norm):
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


@pytest.fixture
def exact_fp8():
    """FP8 weights on the exact route (the `exact_fp8` switch: off by default until a GPU run
    shows it bitwise)."""
    with switched(exact_fp8=True):
        yield


def _fp8(gen, m: int, k: int):
    """An Fp8Matrix of fp16 values (the interpreter's model dtype), rows scaled apart."""
    w = rand(gen, m, k, scale=0.05) * torch.logspace(-1, 1, m, dtype=torch.float32)[:, None]
    return quantize_fp8(w.to(DEVICE), torch.float16)


def test_fp8_weights_on_the_route_are_their_values_times_x(gen, exact_fp8):
    """Against float64 x @ (codes * scales)^T: a code is exact in fp16 and a product of two
    fp16 values exact in float32, so the error is the float32 sums' (at most K terms, each
    addition within 2^-24 of the partial sum: K 2^-24 sum |x w|), the scale's multiply and the
    one rounding to fp16 (2^-11 |y|)."""
    x = rand(gen, ROWS, K).to(torch.float16)
    w = _fp8(gen, 64, K)
    values = w.data.double() * w.scales.double()[:, None]
    for n in (1, 16, ROWS):
        got = linear(x[:n], w).double()
        ref = x[:n].double() @ values.T
        bound = K * 2.0**-24 * (x[:n].double().abs() @ values.abs().T) + 2.0**-11 * ref.abs()
        assert ((got - ref).abs() <= bound * 1.01 + 1e-30).all(), n


def test_speculation_is_refused_where_a_rows_bits_follow_the_width(gen):
    """What startup asks before speculating (muser/startup/start.py): the route's weights
    give a row the same bits at every width, or the reason they do not."""
    from muser.ops.blocks import BlockMatrix
    from muser.ops.triton import width_inexact

    plain, fp8 = rand(gen, 64, K), _fp8(gen, 64, K)
    assert width_inexact([plain]) is None
    assert "FP8 weights keep their FP8 tensor-core route" in width_inexact([plain, fp8])
    with switched(exact_fp8=True):
        assert width_inexact([plain, fp8]) is None
    with switched(exact=False):
        assert width_inexact([plain]) == "the exact route is switched off"
    blocks = object.__new__(BlockMatrix)  # NOTE: only its type is asked
    assert "GGUF block weights" in width_inexact([plain, blocks])


@triton.jit
def _decode(c_ptr, o_ptr):
    r = tl.arange(0, 256)
    tl.store(o_ptr + r, e4m3_values(tl.load(c_ptr + r)))


def test_e4m3_codes_decode_to_their_values():
    """gemv.e4m3_values: every finite e4m3 code (normal, subnormal, both zeros) by bit
    arithmetic is torch's value of it, bit for bit."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _decode[(1,)](codes, out)
    want = codes.view(torch.float8_e4m3fn).float()
    finite = ~want.isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(out[finite].view(torch.int32), want[finite].view(torch.int32))
