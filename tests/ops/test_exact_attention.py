"""The exact attention route's order property (muser/ops/triton/softmax.py): a query row's
output has the same bits as a decode row and as a row of any prefill chunk, whatever the
chunking, whether its keys come from a ring, pages, a contiguous range starting anywhere or the
store in place, and whether a chunk's spans are merged in registers or a span a program.

Under the interpreter a dot sums its whole K step at once; the tiles' row counts differ
(decode: the query heads of a KV head padded to 16; prefill: 64 query rows a head), which is
what the GPU's tensor cores must sum alike (bench/exact_probe.py checks that there)."""

from __future__ import annotations

import math

import pytest
import torch

from muser.ops import ref
from muser.ops.triton import decode_attention, prefill_attention
from muser.ops.triton.prefill_attention import FlashConfig

from opcheck import ATTN_DTYPES, DEVICE, check, rand

N = 330  # positions: spans of 256 keys, tiles of 64, a ring that wraps
# (heads, KV heads, head_dim): a small layout, and on a GPU gemma3-1b's and gemma3-27b's
LAYOUTS = [(4, 2, 32)] + ([(4, 1, 256), (32, 16, 128)] if DEVICE == "cuda" else [])


@pytest.fixture(params=[(d, layout) for d in ATTN_DTYPES for layout in LAYOUTS],
                ids=lambda p: f"{str(p[0]).removeprefix('torch.')}-{p[1][0]}x{p[1][2]}")
def qkv(gen, request):
    dtype, (heads, kv_heads, head_dim) = request.param
    q = rand(gen, N, heads, head_dim, dtype=dtype)
    k = rand(gen, N, kv_heads, head_dim, dtype=dtype)
    v = rand(gen, N, kv_heads, head_dim, dtype=dtype)
    return q, k, v


def _prefill(q, k, v, q0, q1, window, split=False, indexed=False):
    """Rows q0 .. q1 - 1 as one chunk over the keys they see, contiguous from k_start."""
    k_start = 0 if window is None else max(0, q0 - window + 1)
    keys, values = k[k_start:q1], v[k_start:q1]
    read = None
    if indexed:  # the store itself (rows = positions), read in place
        keys, values, read = k, v, torch.arange(k_start, q1, device=DEVICE)
    config = FlashConfig(splits=4, num_warps=4, num_stages=1) if split else None
    return prefill_attention(q[q0:q1], keys, values, q0, k_start, window, q.shape[2]**-0.5,
                             None, 64, read_rows=read, config=config)


def _decode(q, k, v, p, window, capacity=None, new=False):
    """Row p as a decode row: pages of 64 rows (global) or a ring of `capacity` rows holding
    the newest positions at physical position % capacity (sliding, logical key indices)."""
    kv_heads, head_dim = k.shape[1:]
    if window is None:
        rows_k, rows_v, block, dst = k.clone(), v.clone(), 64, p
        table = torch.arange(6, dtype=torch.int32, device=DEVICE)
    else:
        rows_k = torch.zeros(capacity, kv_heads, head_dim, dtype=k.dtype, device=DEVICE)
        rows_v = torch.zeros_like(rows_k)
        lo = max(0, p + 1 - capacity)
        rows_k[torch.arange(lo, p + 1) % capacity] = k[lo:p + 1]
        rows_v[torch.arange(lo, p + 1) % capacity] = v[lo:p + 1]
        table = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        block, dst = capacity, p % capacity
    start = 0 if window is None else max(0, p + 1 - window)
    meta = [torch.tensor([x], dtype=torch.int32, device=DEVICE) for x in (start, p + 1, 0)]
    stored = None
    if new:  # the newest row comes from the step's input and is stored by the kernel
        rows_k[dst], rows_v[dst] = float("nan"), float("nan")
        stored = (k[p:p + 1], v[p:p + 1], torch.tensor([0], dtype=torch.int32, device=DEVICE),
                  torch.tensor([dst], dtype=torch.int32, device=DEVICE))
    out = decode_attention(q[p:p + 1], rows_k, rows_v, table[None], *meta, block,
                           head_dim**-0.5, new=stored)
    if new:
        assert torch.equal(rows_k[dst], k[p]) and torch.equal(rows_v[dst], v[p])
    return out[0]


@pytest.mark.parametrize("window", [None, 96])
def test_decode_rows_and_chunk_rows_agree_bitwise(qkv, window):
    q, k, v = qkv
    whole = _prefill(q, k, v, 0, N, window)
    want = ref.prefill_attention(q.double(), k.double(), v.double(), 0, 0, window,
                                 q.shape[2]**-0.5, None, 64, None)
    check(whole, want, q.dtype, scale=2.0)
    for q0, q1 in [(0, 37), (37, 101), (101, 300), (300, 330), (129, 130), (250, 270)]:
        for split in (False, True):
            for indexed in (False, True):
                part = _prefill(q, k, v, q0, q1, window, split, indexed)
                assert torch.equal(part, whole[q0:q1]), (q0, q1, split, indexed)
    for p in (0, 1, 63, 64, 95, 96, 200, 255, 256, 257, 329):
        for new in (False, True):
            row = _decode(q, k, v, p, window, capacity=128, new=new)
            assert torch.equal(row, whole[p]), (p, new)


def test_a_padding_row_attends_nothing(qkv):
    q, k, v = qkv
    meta = [torch.tensor([x], dtype=torch.int32, device=DEVICE) for x in (0, 0, 0)]
    table = torch.arange(6, dtype=torch.int32, device=DEVICE)[None]
    out = decode_attention(q[:1], k.clone(), v.clone(), table, *meta, 64, 0.125)
    assert torch.equal(out, torch.zeros_like(out))
    assert math.isfinite(float(out.abs().max()))
