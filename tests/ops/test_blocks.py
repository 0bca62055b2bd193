"""GGUF blocks read inside Triton kernels (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) on random
blocks: the dequantization kernel equals `gguf.quants.dequantize` bit for bit; the decode GEMV
over them is within the error bound of its per-sub-block float32 sums of the float64 product, the
K-quants' of x as two int8 levels (int8_rows, equal to its reference bit for bit, within its
own bound)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from muser.ops import ref
from muser.ops.blocks import BlockMatrix
from muser.ops.triton.dequantize_blocks import dequantize_blocks
from muser.ops.triton.gemv_blocks import (
    BlockGemvConfig,
    candidates_blocks,
    default_config,
    linear_blocks,
)
from muser.ops.triton.int8_rows import int8_rows
from muser.ops.triton.launch import cdiv
from tests.error_bounds import gamma

from opcheck import DEVICE, rand

QT = GGMLQuantizationType
# K: 3 blocks of 32 (a partial BLOCK_K), or 2 of 256
SHAPES = {QT.Q5_0: (37, 96), QT.Q8_0: (37, 96), QT.Q4_K: (37, 512), QT.Q6_K: (37, 512),
          QT.Q4_0: (37, 96), QT.Q5_K: (37, 512)}


def _random_blocks(gen: torch.Generator, qtype: QT, m: int, k: int) -> np.ndarray:
    """[m, row bytes] of random blocks: every code and packed scale byte random, the fp16
    super-scales (d, and dmin for Q4_K and Q5_K; at the block's end for Q6_K) random finite
    values."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    nb = k // block_size
    raw = torch.randint(0, 256, (m, nb, type_size), generator=gen, dtype=torch.uint8)
    halves = 2 if qtype in (QT.Q4_K, QT.Q5_K) else 1
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


# the block GEMV: M = 37 (a partial BLOCK_M at every tile), K: several blocks per row, enough
# for SPLIT_K > 1 and a partial last iteration (20 blocks of 32, 6 of 256: 4 per iteration)
GEMV_SHAPES = {QT.Q5_0: (37, 640), QT.Q8_0: (37, 640), QT.Q4_K: (37, 1536), QT.Q6_K: (37, 768),
               QT.Q4_0: (37, 640), QT.Q5_K: (37, 1536)}
CODES = {QT.Q5_0: (2, 22), QT.Q8_0: (2, 34), QT.Q4_K: (16, 144), QT.Q6_K: (0, 192),
         QT.Q4_0: (2, 18), QT.Q5_K: (16, 176)}  # code bytes (Q5_K's high bits included)
# The kernels' sums (gemv_blocks.py), per type: B values per sub-block (0: the K-quants' integer
# sums, exact); T additions into an accumulator element per iteration; E accumulator elements
# per output and block
SUMS = {QT.Q5_0: (0, 1, 1), QT.Q8_0: (1, 1, 2), QT.Q4_K: (0, 2, 4), QT.Q6_K: (0, 4, 4),
        QT.Q4_0: (0, 1, 1), QT.Q5_K: (0, 2, 4)}


def _depth(qtype: QT, k: int, c: BlockGemvConfig) -> int:
    """The most roundings on any product's path to y: a partial sum of at most B codes (or of B
    x values), its scale multiply and offset subtraction, T per iteration into an accumulator,
    the final sum of the program's accumulators (NB E), the split's partials, and acc - off."""
    b, t, e = SUMS[qtype]
    blocks = k // GGML_QUANT_SIZES[qtype][0]
    per_split = cdiv(cdiv(blocks, c.split_k), c.blocks) * c.blocks
    return b + 2 + t * (per_split // c.blocks) + c.blocks * e + cdiv(blocks, per_split) + 1


def _offsets(raw: np.ndarray, qtype: QT, k: int) -> torch.Tensor:
    """[M, K] float64 offsets o_k = -t_j of w_k = s_j q_k - t_j: the blocks with every code 0."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    lo, hi = CODES[qtype]
    blocks = raw.reshape(raw.shape[0], -1, type_size).copy()
    blocks[..., lo:hi] = 0
    o = gguf.quants.dequantize(blocks.reshape(raw.shape), qtype).reshape(raw.shape[0], k)
    return torch.from_numpy(o).double()


def x_hat(x: torch.Tensor) -> torch.Tensor:
    """[N, K] float64: the values int8_rows(x) stands for, s (128 h + l) (ref.int8_rows)."""
    hi, lo, scale, _, _ = ref.int8_rows(x)
    n, k = x.shape
    h, low = (v.view(torch.int8).reshape(n, k).double() for v in (hi, lo))
    return (128 * h + low) * scale.double().repeat_interleave(32, dim=1)


@pytest.mark.parametrize("k", [1024, 608])  # whole 256s, and a last partial one (Q8_0's rows)
def test_int8_rows(gen, k):
    """int8_rows equals its reference bit for bit on rows of mixed magnitudes (a zero group, a
    subnormal one, huge and tiny values side by side); x^ is within s / 2 of x, every bfloat16
    value within 2^5 of its group's largest is kept exactly, and the sums are x^'s (the half
    sums of a partial 256 as if zeros followed)."""
    n = 3
    x = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-30, 30, (n, k),
                                                                     generator=gen).float())
    x[0, :32] = 0.0
    x[1, 32:64] = torch.randn(32, generator=gen) * 1e-40  # subnormal
    x[2, 64:96] = (2 * torch.rand(32, generator=gen) - 1) * 3e38  # into the top binade
    x = x.to(torch.bfloat16).float()
    got, want = int8_rows(x.to(DEVICE)), ref.int8_rows(x)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)
    xq, scale = x_hat(x), got.scale.cpu().double().repeat_interleave(32, dim=1)
    assert ((xq - x.double()).abs() <= scale / 2).all()
    top = x.abs().reshape(n, -1, 32).amax(-1).repeat_interleave(32, dim=1)
    near = (x.abs() >= top / 32) & (top >= 2.0**-114)  # above the floor of the scale exponent
    assert torch.equal(xq[near], x.double()[near])
    levels = torch.nn.functional.pad(xq / scale, (0, -k % 256))
    halves = levels.reshape(n, -1, 8, 2, 16).sum(-1)
    assert torch.equal(got.sums.cpu().double(), halves.sum(-1).reshape(n, -1)[:, :k // 32])
    assert torch.equal(got.half_sums.cpu().double(), halves.transpose(2, 3).reshape(n, -1))


@pytest.mark.parametrize("qtype", list(GEMV_SHAPES), ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_gemv_over_blocks(gen, qtype, n):
    """Every candidate config (partial row blocks, several blocks per row, splits over K) within
    the kernel's error bound (gemv_blocks.py): each product x q (or x value, for the offsets)
    reaches y through at most D roundings (_depth), so |y - exact| <= gamma_D sum_k |x_k|
    (|s_j q_k| + |t_j|) (Higham: a sum by any tree is within gamma of its depth).
    The magnitudes come from gguf's w = fl(s q - t) and o = -t (exact): a = w - o is within
    u |s q - t| of s q, and the float64 reference of gguf's w is off by the same (one more
    rounding each: gamma_(D + 2)), plus its own K 2^-53. The K-quants multiply x^, the values
    of int8_rows(x) (exact: x^ - x is int8_rows' error, bounded in test_int8_rows), and their
    integer sums are exact (B = 0)."""
    m, k = GEMV_SHAPES[qtype]
    raw = _random_blocks(gen, qtype, m, k)
    w = _matrix(raw, qtype, k)
    x = rand(gen, n, k)
    xq = x_hat(x.cpu())
    exact = xq @ w.dequantize().double().cpu().t()
    o = _offsets(raw, qtype, k)
    wd = w.dequantize().double().cpu()
    mag = xq.abs() @ ((wd - o).abs() + o.abs()).t()
    configs = candidates_blocks(n, m, k, qtype)
    assert any(c.split_k > 1 for c in configs) and any(m % c.block_m for c in configs)
    for config in [default_config(n, m, k, qtype), *configs]:
        bound = (gamma(_depth(qtype, k, config) + 2) + k * 2.0**-53) * mag
        y = linear_blocks(x, w, config)
        assert y.shape == (n, m) and y.dtype == torch.float32 and not y.isnan().any()
        assert ((y.double().cpu() - exact).abs() <= bound).all(), config
