from __future__ import annotations

import pytest
import torch

from muser.attention.dense_ref import attention_dense
from muser.attention.routes import Route
from muser.attention.tiles import classify_tiles
from muser.ops.triton import prefill_attention
from opcheck import ATTN_DTYPES, DEVICE, check, rand



@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize(
    "num_q,q_start,k_start,num_prev,window",
    [
        (64, 0, 0, 0, None),  # first chunk, causal
        (50, 96, 0, 96, None),  # later chunk, ragged tail tile
        (80, 40, 9, 31, 32),  # staging shadow: window tail then the chunk
        (64, 0, 0, 0, 16),  # window shorter than a tile
    ],
)
def test_flash(gen, dtype, num_q, q_start, k_start, num_prev, window):
    heads, kv_heads, head_dim, tile = 4, 2, 64, 16
    num_k = num_prev + num_q
    q = rand(gen, num_q, heads, head_dim)
    keys = rand(gen, num_k, kv_heads, head_dim, dtype=dtype)
    values = rand(gen, num_k, kv_heads, head_dim, dtype=dtype)
    tiles = classify_tiles(q_start, num_q, k_start, num_k, window, tile, tile)
    out = prefill_attention(q, keys, values, q_start, k_start, window, 0.125, tiles.to(DEVICE),
                            tile, Route.TILED)
    q_pos = torch.arange(q_start, q_start + num_q)
    k_pos = torch.arange(k_start, k_start + num_k)
    expect = attention_dense(q.cpu().double(), keys.cpu().double(), values.cpu().double(),
                             q_pos, k_pos, window, 0.125, torch.float64)
    check(out.float(), expect, dtype)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_flash_strided_rows(gen, dtype):
    """Keys and values attended where a chunk with nothing cached before it has them: its
    own new rows, the values a strided view into the fused QKV projection's output."""
    num_q, heads, kv_heads, head_dim, tile = 40, 4, 2, 64, 16
    keys = rand(gen, num_q, kv_heads, head_dim, dtype=dtype)
    qkv = rand(gen, num_q, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    values = qkv[:, (heads + kv_heads) * head_dim:].view(num_q, kv_heads, head_dim)
    q = rand(gen, num_q, heads, head_dim)
    tiles = classify_tiles(0, num_q, 0, num_q, None, tile, tile)
    out = prefill_attention(q, keys, values, 0, 0, None, 0.125, tiles.to(DEVICE), tile,
                            Route.TILED)
    pos = torch.arange(num_q)
    expect = attention_dense(q.cpu().double(), keys.cpu().double(), values.cpu().double(), pos,
                             pos, None, 0.125, torch.float64)
    check(out.float(), expect, dtype)
