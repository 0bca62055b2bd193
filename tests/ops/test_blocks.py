"""GGUF blocks read inside Triton kernels (Q5_0, Q8_0, Q4_K, Q6_K) on random blocks: the dequantization
kernel equals `gguf.quants.dequantize` bit for bit, and the decode GEMV over the blocks is
within the error bound of its float32 sum of the float64 product."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from opcheck import DEVICE, rand

from muser.ops import ref
from muser.ops.blocks import BlockMatrix
from muser.ops.triton.dequantize_blocks import dequantize_blocks
from muser.ops.triton.gemv_blocks import linear_blocks
from tests.error_bounds import gamma

QT = GGMLQuantizationType
# K: 3 blocks of 32 (a partial BLOCK_K), or 2 of 256
SHAPES = {QT.Q5_0: (37, 96), QT.Q8_0: (37, 96), QT.Q4_K: (37, 512), QT.Q6_K: (37, 512)}


def _random_blocks(gen: torch.Generator, qtype: QT, m: int, k: int) -> np.ndarray:
    """[m, row bytes] of random blocks: every code and packed scale byte random, the fp16
    super-scales (d, and dmin for Q4_K; at the block's end for Q6_K) random finite values."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    nb = k // block_size
    raw = torch.randint(0, 256, (m, nb, type_size), generator=gen, dtype=torch.uint8)
    halves = 2 if qtype == QT.Q4_K else 1
    at = type_size - 2 if qtype == QT.Q6_K else 0
    scales = (torch.rand(m, nb, halves, generator=gen) - 0.5) * 0.2
    raw[..., at:at + 2 * halves] = scales.half().view(torch.uint8).view(m, nb, 2 * halves)
    return raw.reshape(m, -1).numpy()


def _matrix(raw: np.ndarray, qtype: QT, k: int) -> BlockMatrix:
    data = torch.from_numpy(raw).to(DEVICE)
    return BlockMatrix.from_raw(data, qtype, (raw.shape[0], k))


@pytest.mark.parametrize("qtype", list(SHAPES), ids=lambda q: q.name)
def test_dequantize_equals_gguf(gen, qtype):
    m, k = SHAPES[qtype]
    raw = _random_blocks(gen, qtype, m, k)
    expect = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(m, k))
    w = _matrix(raw, qtype, k)
    assert torch.equal(dequantize_blocks(w, torch.float32).cpu(), expect)
    assert torch.equal(dequantize_blocks(w, torch.float16).cpu(), expect.half())
    assert torch.equal(ref.dequantize_blocks(w, torch.float32).cpu(), expect)


def test_dequantize_gguf_quantized_q8_0(gen):
    """Blocks from gguf's own quantizer too (values of a real distribution)."""
    x = torch.randn(37, 96, generator=gen).numpy()
    raw = gguf.quants.quantize(x, QT.Q8_0)
    expect = torch.from_numpy(gguf.quants.dequantize(raw, QT.Q8_0))
    assert torch.equal(dequantize_blocks(_matrix(raw, QT.Q8_0, 96), torch.float32).cpu(), expect)


@pytest.mark.parametrize("qtype", list(SHAPES), ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_gemv_over_blocks(gen, qtype, n):
    """The weights are exact (test above), so the only error is the float32 sum of K products:
    each product rounds once and the K-term sum, in any order, adds gamma_(K-1) of the sum of
    magnitudes, |y - exact| <= gamma_K * sum_k |x w| (the float64 reference's own error is
    below K 2^-53 of the same)."""
    m, k = SHAPES[qtype]
    w = _matrix(_random_blocks(gen, qtype, m, k), qtype, k)
    x = rand(gen, n, k)
    y = linear_blocks(x, w)
    exact = ref.linear_blocks(x.double(), w)
    wd = w.dequantize().double()
    bound = (gamma(k) + k * 2.0**-53) * (x.double().abs() @ wd.abs().t())
    assert y.shape == (n, m) and y.dtype == torch.float32 and not y.isnan().any()
    assert ((y.double() - exact).abs() <= bound).all()
