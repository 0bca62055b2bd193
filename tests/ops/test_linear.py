from __future__ import annotations

import pytest
import torch

from muser.ops import ref
from muser.ops.triton import linear, linear_add_rms_norm, linear_geglu

from opcheck import DTYPES, check, rand


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 8, 24])  # GEMV rows (<= 8) and the GEMM path
def test_linear(gen, dtype, n):
    x, w = rand(gen, n, 200), rand(gen, 72, 200, dtype=dtype, scale=0.07)
    out = linear(x, w)
    check(out, ref.linear(x.double().to(dtype).double(), w.double()), dtype)


def _geglu_expect(x, w, dtype):
    """The reference with its roundings: x and the projection's output to the weight dtype."""
    y = (x.to(dtype).double() @ w.double().t()).to(dtype).double()
    return ref.geglu(y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 17])
def test_linear_geglu(gen, dtype, n):
    x, w = rand(gen, n, 96), rand(gen, 2 * 40, 96, dtype=dtype, scale=0.1)
    check(linear_geglu(x, w), _geglu_expect(x, w, dtype), dtype, scale=2.0)


def _norm_args(gen, n, m, dtype):
    res = rand(gen, n, m)
    post, nxt = rand(gen, m, scale=0.5) + 1, rand(gen, m, scale=0.5) + 1
    return res, post, nxt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(1, 1100), (3, 1100), (17, 1100), (2, 4100)])
def test_linear_add_rms_norm(gen, dtype, n, m):
    """The residual add + norm pair after o_proj / down, fused into the decode GEMV (n <= 8);
    the normed output in the projections' dtype, as the decoder asks for. Rows of 1,100 are
    normalized in one block, rows of 4,100 in passes over blocks."""
    x, w = rand(gen, n, 96), rand(gen, m, 96, dtype=dtype, scale=0.1)
    res, post, nxt = _norm_args(gen, n, m, dtype)
    h, y = linear_add_rms_norm(x, w, res, post, nxt, 1e-6, dtype)
    proj = (x.to(dtype).double() @ w.double().t()).to(dtype).double()
    h_ref, y_ref = ref.add_rms_norm(res.double(), proj, post.double(), nxt.double(), 1e-6)
    assert h.dtype == torch.float32 and y.dtype == dtype
    check(h, h_ref, torch.float32 if dtype == torch.float32 else dtype, scale=2.0)
    check(y, y_ref, dtype, scale=2.0)


def _check_epilogue(out, epilogue: str, proj: torch.Tensor, norm, dtype) -> None:
    """out of a projection (float64 result `proj`, rounded) with its epilogue vs float64."""
    if epilogue == "plain":
        check(out, proj, dtype)
    elif epilogue == "geglu":
        check(out, ref.geglu(proj), dtype, scale=2.0)
    else:
        want = ref.add_rms_norm(norm.residual.double(), proj, norm.post.double(),
                                norm.next.double(), 1e-6)
        check(out[0], want[0], dtype, scale=2.0)
        check(out[1], want[1], dtype, scale=2.0)


@pytest.mark.parametrize("epilogue", ["plain", "geglu", "norm"])
def test_every_gemv_config(gen, epilogue):
    """Each config the GPU may pick (FMA or tensor-core tiles, split over K or not, whose
    partials the last program of a row block sums), with each epilogue. Two launches in a row
    also check that the arrival counters are left at zero."""
    from muser.ops.triton.gemv import GemvConfig, NormEpilogue, candidates, gemv

    dtype, k, m = torch.float16, 96, 40
    x, w = rand(gen, 2, k), rand(gen, m, k, dtype=dtype, scale=0.1)
    proj = (x.to(dtype).double() @ w.double().t()).to(dtype).double()
    res, post, nxt = _norm_args(gen, 2, m, dtype)
    norm = NormEpilogue(res, post, nxt, 1e-6, dtype) if epilogue == "norm" else None
    configs = candidates(2, m, k) + [GemvConfig("fma", 4, 32, 3, 4),
                                     GemvConfig("dot", 16, 32, 2, 4)]
    for c in configs:
        for _ in range(2):
            _check_epilogue(gemv(x, w, c, geglu=epilogue == "geglu", norm=norm), epilogue, proj,
                            norm, dtype)


@pytest.mark.parametrize("epilogue", ["plain", "geglu", "norm"])
@pytest.mark.parametrize("n,m", [(37, 72), (70, 1100)])
def test_every_gemm_config(gen, epilogue, n, m):
    """The prefill GEMM with each config the GPU may pick and each epilogue: rows and K (96)
    that fill no tile exactly, several row blocks, each normalized by its last program (rows
    of 1,100 in two column passes). Two launches in a row also check that the arrival counters
    are left at zero."""
    from muser.ops.triton.gemm import CANDIDATES, SMALL, gemm
    from muser.ops.triton.gemv import NormEpilogue

    dtype, k = torch.float16, 96
    x, w = rand(gen, n, k), rand(gen, m, k, dtype=dtype, scale=0.1)
    proj = (x.to(dtype).double() @ w.double().t()).to(dtype).double()
    res, post, nxt = _norm_args(gen, n, m, dtype)
    norm = NormEpilogue(res, post, nxt, 1e-6, dtype) if epilogue == "norm" else None
    for c in [SMALL, *CANDIDATES]:
        for _ in range(2):
            out = gemm(x, w, c, geglu=epilogue == "geglu", norm=norm)
            if norm is not None:
                assert out[0].dtype == torch.float32 and out[1].dtype == dtype
            _check_epilogue(out, epilogue, proj, norm, dtype)
