"""The scaled embedding lookup in one launch (ops/triton/embed.py) against float64 arithmetic:
every product of two float32 values is exact in float64, so rounding it to float32 gives the
one correctly rounded float32 product the kernel must store, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from muser.ops import ref
from muser.ops.fp8 import quantize_fp8
from muser.ops.triton import embed

from opcheck import DEVICE, DTYPES, rand

SCALE = math.sqrt(640.0)


def _ids(gen, n: int, vocab: int, fed: bool):
    """n ids, every other one -1 when fed (those rows read feed's), and the feed."""
    ids = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int32)
    feed = torch.randint(0, vocab, (n + 3,), generator=gen, dtype=torch.int32)
    if fed:
        ids[::2] = -1
    return ids.to(DEVICE), feed.to(DEVICE)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,dim,fed", [(1, 640, False), (5, 1100, True), (3, 2048, True)])
def test_dense_table(gen, dtype, n, dim, fed):
    """dim 1,100: a last program half masked; fed rows take the feed's id."""
    table = rand(gen, 50, dim, dtype=dtype)
    ids, feed = _ids(gen, n, 50, fed)
    got = embed(table, ids, SCALE, feed if fed else None)
    rows = torch.where(ids < 0, feed[:n], ids).long()
    want = (_f32(table)[rows] * _f32(torch.tensor(SCALE))).float()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(got, ref.embed(table, ids, SCALE, feed if fed else None))


@pytest.mark.parametrize("n,fed", [(4, True), (2, False)])
def test_fp8_table(gen, n, fed):
    """A tied FP8 head as the table: each row's codes times its scale, rounded to float32,
    then times the embedding's scale, rounded again (Fp8Matrix.dequantize, then the scale)."""
    table = quantize_fp8(rand(gen, 40, 1100, dtype=torch.float32) * 3, torch.float16)
    ids, feed = _ids(gen, n, 40, fed)
    got = embed(table, ids, SCALE, feed if fed else None)
    rows = torch.where(ids < 0, feed[:n], ids).long()
    dequantized = (_f32(table.data)[rows] * _f32(table.scales)[rows, None]).float()
    want = (dequantized.double() * _f32(torch.tensor(SCALE))).float()
    assert torch.equal(got, want)
    assert torch.equal(got, ref.embed(table, ids, SCALE, feed if fed else None))
