from __future__ import annotations

import pytest
import torch

from muser.ops import ref
from muser.ops.triton import geglu_linear, linear
from opcheck import DTYPES, check, rand


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 8, 24])  # GEMV rows (<= 8) and the GEMM path
def test_linear(gen, dtype, n):
    x, w = rand(gen, n, 200), rand(gen, 72, 200, dtype=dtype, scale=0.07)
    out = linear(x, w)
    check(out, ref.linear(x.double().to(dtype).double(), w.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 17])
def test_geglu_linear(gen, dtype, n):
    gate_up, w = rand(gen, n, 2 * 96, dtype=dtype), rand(gen, 40, 96, dtype=dtype, scale=0.1)
    out = geglu_linear(gate_up, w)
    expect = ref.linear(ref.geglu(gate_up.double()), w.double())
    check(out, expect, dtype, scale=2.0)


@pytest.mark.parametrize("geglu", [False, True])
def test_every_gemv_config(gen, geglu):
    """Each config the GPU may pick (FMA or tensor-core tiles, split over K or not)."""
    from muser.ops.triton.gemv import GemvConfig, candidates, gemv

    dtype = torch.float16
    k = 96
    x = rand(gen, 2, 2 * k if geglu else k, dtype=dtype)
    w = rand(gen, 40, k, dtype=dtype, scale=0.1)
    xs = ref.geglu(x.double()) if geglu else x.double()
    expect = xs.to(dtype).double() @ w.double().t()
    configs = candidates(2, 40, k) + [GemvConfig("fma", 4, 32, 3, 4),
                                      GemvConfig("dot", 16, 32, 2, 4)]
    for c in configs:
        check(gemv(x, w, geglu, c), expect, dtype, scale=2.0)
