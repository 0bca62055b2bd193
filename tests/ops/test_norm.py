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


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_output_in_projection_dtype(gen, dtype):
    """The normed output comes in the next projection's dtype (rounded once, as the projection
    would); the residual stays float32."""
    res, x = rand(gen, 3, 640, scale=3.0), rand(gen, 3, 640)
    post, nxt = 1 + rand(gen, 640, scale=0.1), 1 + rand(gen, 640, scale=0.1)
    r_out, y = add_rms_norm(res, x, post, nxt, 1e-6, dtype)
    assert r_out.dtype == torch.float32 and y.dtype == dtype
    r_ref, y_ref = ref.add_rms_norm(res.double(), x.double(), post.double(), nxt.double(), 1e-6)
    check(r_out, r_ref, torch.float32, scale=4.0)
    check(y.float(), y_ref, dtype, scale=4.0)
    assert rms_norm(x, nxt, 1e-6, dtype).dtype == dtype
    assert ref.rms_norm(x, nxt, 1e-6, dtype).dtype == dtype
