"""The FP8 KV cache (muser/ops/kv_fp8.py): its rows' error model, the kernels' stores against
the reference bit for bit, and the exact attention route over FP8 rows: against float64 within
a bound derived from e4m3's precision, and bitwise across chunkings, key layouts and decode
rows (as tests/ops/test_exact_attention.py checks for 16-bit caches).

Under the interpreter codes are uint8 reinterpreted as float8e4nv (its conversions from fp8 are
exact for every finite code; to fp8 it truncates, which the kernels never rely on: they round
first, muser/ops/triton/kv_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from muser.ops import ref
from muser.ops.kv_fp8 import dequantize_rows, packed, quantize_rows
from muser.ops.triton import (
    decode_attention,
    prefill_attention,
    qk_norm_rope_pair,
    stage_gather,
    store_kv,
)
from muser.ops.triton.prefill_attention import FlashConfig

from opcheck import ATTN_DTYPES, DEVICE, DTYPES, TOL, check, rand

N = 330  # positions: spans of 256 keys, tiles of 64, a ring that wraps
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
SUBNORMAL = 2.0**-6  # below this (times the scale) e4m3 is subnormal, spacing 2^-9


def error_bound(x: torch.Tensor) -> torch.Tensor:
    """|x - dequantized| allowed per value: half an e4m3 ulp, 2^-4 |x| in the normal range and
    2^-10 p among the subnormals, with p < amax / 224 the row's scale."""
    p = x.abs().amax(-1, keepdim=True).double() / 224
    return torch.maximum(x.abs().double() * 2.0**-4, p * 2.0**-10)


def test_rows_round_within_e4m3_precision(gen):
    x = torch.randn(200, 3, 64, generator=gen, dtype=torch.float64).float()
    x[:50] *= 1e-3
    x[50:100] *= 300.0
    x[100, 0] = 0.0  # a zero row: zero codes
    x[101, 1, :8] = 1e-9  # values far below the row's scale: subnormal, or zero
    rows = quantize_rows(x)
    assert rows.shape == (200, 3, packed(64)) and rows.dtype == torch.uint8
    assert not rows[..., 65:].any(), "the bytes after the exponent are zero"
    back = dequantize_rows(rows)
    assert torch.all((back.double() - x.double()).abs() <= error_bound(x))
    assert torch.equal(back[100, 0], torch.zeros(64))
    assert torch.equal(dequantize_rows(quantize_rows(back)), back), "a code's value is kept"
    # the scale is a power of two with the row's largest in (224, 448] (rounded: >= 224)
    top = (back.abs().amax(-1) / (rows[..., 64].to(torch.int32) << 23).view(torch.float32))
    top = top[x.abs().amax(-1) > 0]
    assert torch.all((top >= 224) & (top <= 448))


def _kv(gen, n, dtype, scale=4.0):
    k = rand(gen, n, KV_HEADS, HEAD_DIM, dtype=dtype)
    v = (rand(gen, n, KV_HEADS, HEAD_DIM, dtype=torch.float32) * scale).to(dtype)
    return k, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_stores_quantize_as_the_reference(gen, dtype):
    k_new, v_new = _kv(gen, 6, dtype)
    src = torch.tensor([1, 2, 3, 5], device=DEVICE)
    dst = torch.tensor([7, -1, 39, 0], device=DEVICE)
    rows = [torch.zeros(40, KV_HEADS, packed(HEAD_DIM), dtype=torch.uint8, device=DEVICE)
            for _ in range(4)]
    store_kv(rows[0], rows[1], k_new, v_new, src, dst)
    ref.store_kv(rows[2], rows[3], k_new, v_new, src, dst)
    assert torch.equal(rows[0], rows[2]) and torch.equal(rows[1], rows[3])
    assert torch.equal(rows[0][39], quantize_rows(k_new[3]))
    read = torch.tensor([39, 0, 7, 2], device=DEVICE)
    for new in ((None, None), _kv(gen, 5, dtype)):
        out = stage_gather(rows[0], rows[1], read, *new)
        want = ref.stage_gather(rows[0], rows[1], read, *new)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    q = rand(gen, 5, HEADS, HEAD_DIM, dtype=dtype)
    k, v = _kv(gen, 5, dtype)
    weights = [torch.rand(HEAD_DIM, generator=gen).to(DEVICE) + 0.5 for _ in range(2)]
    angles = [torch.rand(5, HEAD_DIM // 2, generator=gen).to(DEVICE) for _ in range(2)]
    at = torch.tensor([3, -1, 0, 9, 7], device=DEVICE)
    pair = [torch.zeros(12, KV_HEADS, packed(HEAD_DIM), dtype=torch.uint8, device=DEVICE)
            for _ in range(4)]
    _, k_out = qk_norm_rope_pair(q, k, *weights, *angles, 1e-6, torch.float32,
                                 (pair[0], pair[1], v, at))
    ref.store_kv(pair[2], pair[3], k_out, v, torch.arange(5, device=DEVICE), at)
    assert torch.equal(pair[0], pair[2]) and torch.equal(pair[1], pair[3])


@pytest.fixture(params=ATTN_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def qkv(gen, request):
    """q, the float keys and values, and their packed FP8 rows."""
    dtype = request.param
    q = rand(gen, N, HEADS, HEAD_DIM, dtype=dtype)
    k, v = _kv(gen, N, dtype)
    return q, k, v, quantize_rows(k), quantize_rows(v)


def _prefill(q, pk, pv, q0, q1, window, split=False, indexed=False):
    """Rows q0 .. q1 - 1 as one chunk over the packed keys they see, contiguous from
    k_start, or read in place from the store (rows = positions)."""
    k_start = 0 if window is None else max(0, q0 - window + 1)
    keys, values, read = pk[k_start:q1], pv[k_start:q1], None
    if indexed:
        keys, values, read = pk, pv, torch.arange(k_start, q1, device=DEVICE)
    config = FlashConfig(splits=4, num_warps=4, num_stages=1) if split else None
    return prefill_attention(q[q0:q1], keys, values, q0, k_start, window, HEAD_DIM**-0.5, None,
                             64, read_rows=read, config=config, dtype=q.dtype)


def _decode(q, k, v, pk, pv, p, window, new=False):
    """Row p as a decode row over pages of 64 rows (global) or a ring of 128 (sliding); with
    `new` its own row comes from the float input, quantized and stored by the kernel."""
    capacity = 128
    if window is None:
        rows_k, rows_v, block, dst = pk.clone(), pv.clone(), 64, p
        table = torch.arange(6, dtype=torch.int32, device=DEVICE)
    else:
        rows_k = torch.zeros(capacity, *pk.shape[1:], dtype=torch.uint8, device=DEVICE)
        rows_v = torch.zeros_like(rows_k)
        lo = max(0, p + 1 - capacity)
        rows_k[torch.arange(lo, p + 1) % capacity] = pk[lo:p + 1]
        rows_v[torch.arange(lo, p + 1) % capacity] = pv[lo:p + 1]
        table = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        block, dst = capacity, p % capacity
    start = 0 if window is None else max(0, p + 1 - window)
    meta = [torch.tensor([x], dtype=torch.int32, device=DEVICE) for x in (start, p + 1, 0)]
    stored = None
    if new:
        rows_k[dst], rows_v[dst] = 0xFF, 0xFF  # NaN codes: the kernel must not read them
        stored = (k[p:p + 1], v[p:p + 1], torch.tensor([0], dtype=torch.int32, device=DEVICE),
                  torch.tensor([dst], dtype=torch.int32, device=DEVICE))
    out = decode_attention(q[p:p + 1], rows_k, rows_v, table[None], *meta, block,
                           HEAD_DIM**-0.5, new=stored, dtype=q.dtype)
    if new:
        assert torch.equal(rows_k[dst], pk[p]) and torch.equal(rows_v[dst], pv[p])
    return out[0]


def _quantization_bound(q, k, v, pk, pv) -> torch.Tensor:
    """Per query row, |softmax(q k^T s) v - the same over the dequantized K, V| allowed: with
    every score of row i moved by at most d_i (its largest |s q_i . dk_j|), each weight moves
    by a factor within exp(+-2 d_i), so the weights' changes sum to at most exp(2 d_i) - 1
    (times max |v|), and the values' own changes add at most max |dv|; dk, dv are within
    error_bound (test_rows_round_within_e4m3_precision)."""
    dk = dequantize_rows(pk, torch.float64) - k.double()
    dv = dequantize_rows(pv, torch.float64) - v.double()
    group = q.shape[1] // k.shape[1]
    ds = torch.einsum("nhd,mhd->hnm", q.double(), dk.repeat_interleave(group, 1))
    d = HEAD_DIM**-0.5 * ds.abs().amax(2).amax(0)  # [N]
    return dv.abs().max() + v.double().abs().max() * (torch.exp(2 * d) - 1)


@pytest.mark.parametrize("window", [None, 96])
def test_attention_over_fp8_rows(qkv, window):
    """Against float64: over the dequantized rows within the dtype's tolerance; over the float
    K, V within the quantization's bound on top."""
    q, k, v, pk, pv = qkv
    whole = _prefill(q, pk, pv, 0, N, window)
    scale = HEAD_DIM**-0.5
    want = ref.prefill_attention(q.double(), dequantize_rows(pk, torch.float64),
                                 dequantize_rows(pv, torch.float64), 0, 0, window, scale, None,
                                 64, None)
    check(whole, want, q.dtype, scale=8.0)
    exact = ref.prefill_attention(q.double(), k.double(), v.double(), 0, 0, window, scale, None,
                                  64, None)
    bound = _quantization_bound(q, k, v, pk, pv)
    # NOTE: a bound tighter than the trivial one (any output is within max |v| of another)
    assert float(bound.max()) < float(v.abs().max()) / 2
    tol = TOL[q.dtype][0] * 8.0 + TOL[q.dtype][1] * exact.abs()  # the dots' own rounding
    err = (whole.double().cpu() - exact.cpu()).abs()
    assert torch.all(err <= bound.cpu()[:, None, None] + tol.cpu())


@pytest.mark.parametrize("window", [None, 96])
def test_fp8_rows_agree_bitwise_across_widths(qkv, window):
    """The exact route over FP8 rows: any chunk, split or read in place, and decode rows over
    a ring or pages (with the step's own row quantized in the kernel) give the one-chunk bits."""
    q, k, v, pk, pv = qkv
    whole = _prefill(q, pk, pv, 0, N, window)
    for q0, q1 in [(0, 37), (37, 101), (101, 300), (300, 330), (129, 130), (250, 270)]:
        for split in (False, True):
            for indexed in (False, True):
                part = _prefill(q, pk, pv, q0, q1, window, split, indexed)
                assert torch.equal(part, whole[q0:q1]), (q0, q1, split, indexed)
    for p in (0, 1, 63, 64, 95, 96, 200, 255, 256, 257, 329):
        for new in (False, True):
            row = _decode(q, k, v, pk, pv, p, window, new=new)
            assert torch.equal(row, whole[p]), (p, new)


def test_staged_chunk_equals_stored_chunk(qkv):
    """A chunk attended from the staging shadow (cache rows + its own float rows quantized by
    the gather) gives the bits of the same chunk read from the store in place."""
    q, k, v, pk, pv = qkv
    read = torch.arange(0, 200, device=DEVICE)
    keys, values = stage_gather(pk, pv, read, k[200:260], v[200:260])
    staged = prefill_attention(q[200:260], keys, values, 200, 0, None, HEAD_DIM**-0.5, None, 64,
                               dtype=q.dtype)
    assert torch.equal(staged, _prefill(q, pk, pv, 200, 260, None, indexed=True))


def test_the_other_route_refuses_fp8(qkv):
    from muser.errors import MuserError
    from muser.ops.triton.switches import switched

    q, _, _, pk, pv = qkv
    with switched(exact=False), pytest.raises(MuserError, match="exact attention route"):
        prefill_attention(q[:64], pk[:64], pv[:64], 0, 0, None, 0.1, None, 64, dtype=q.dtype)
