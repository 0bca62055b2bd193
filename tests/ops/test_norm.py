from __future__ import annotations

import pytest
import torch

from muser.ops import ref
from muser.ops.triton import add_rms_norm, rms_norm
from opcheck import DTYPES, check, rand


@pytest.mark.parametrize("n,d", [(1, 64), (5, 1152), (3, 300)])
def test_rms_norm(gen, n, d):
    x, w = rand(gen, n, d), 1 + rand(gen, d, scale=0.1)
    check(rms_norm(x, w, 1e-6), ref.rms_norm(x.double(), w.double(), 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d", [(1, 640), (7, 1152)])
def test_add_rms_norm(gen, dtype, n, d):
    res, x = rand(gen, n, d, scale=3.0), rand(gen, n, d, dtype=dtype)
    post, nxt = 1 + rand(gen, d, scale=0.1), 1 + rand(gen, d, scale=0.1)
    r_out, y = add_rms_norm(res, x, post, nxt, 1e-6)
    r_ref, y_ref = ref.add_rms_norm(res.double(), x.double(), post.double(), nxt.double(), 1e-6)
    check(r_out, r_ref, torch.float32, scale=4.0)
    check(y, y_ref, torch.float32, scale=4.0)
