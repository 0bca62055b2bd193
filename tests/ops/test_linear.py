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
