from __future__ import annotations

import pytest
import torch

from muser.ops import ref
from muser.ops.triton import stage_gather, store_kv

from opcheck import DEVICE, DTYPES, rand


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(gen, dtype):
    k_rows, v_rows = rand(gen, 40, 2, 64, dtype=dtype), rand(gen, 40, 2, 64, dtype=dtype)
    kv = rand(gen, 6, 6, 64)  # a strided v view, as from the QKV split
    k_new, v_new = kv[:, :2], kv[:, 2:4]
    src = torch.tensor([1, 2, 3, 5], device=DEVICE)
    dst = torch.tensor([7, -1, 39, 0], device=DEVICE)
    k_ref, v_ref = k_rows.clone(), v_rows.clone()
    store_kv(k_rows, v_rows, k_new, v_new, src, dst)
    ref.store_kv(k_ref, v_ref, k_new, v_new, src, dst)
    assert torch.equal(k_rows, k_ref) and torch.equal(v_rows, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_new", [False, True])
def test_stage_gather(gen, dtype, with_new):
    k_rows, v_rows = rand(gen, 50, 2, 64, dtype=dtype), rand(gen, 50, 2, 64, dtype=dtype)
    read = torch.tensor([45, 46, 47, 48, 49, 0, 1, 2], device=DEVICE)  # a wrapped ring tail
    new = (rand(gen, 5, 2, 64), rand(gen, 5, 2, 64)) if with_new else (None, None)
    out = stage_gather(k_rows, v_rows, read, *new)
    expect = ref.stage_gather(k_rows, v_rows, read, *new)
    assert out[0].is_contiguous() and torch.equal(out[0], expect[0])
    assert torch.equal(out[1], expect[1])
