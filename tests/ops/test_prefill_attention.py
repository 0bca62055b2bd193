from __future__ import annotations

import pytest
import torch

from muser.attention.routes import Route
from muser.ops.dense_ref import attention_dense
from muser.ops.tiles import classify_tiles
from muser.ops.triton import prefill_attention
from muser.ops.triton.prefill_attention import SHARED, FlashConfig, launch_config, shared_bytes
from muser.ops.triton.switches import switched

from opcheck import ATTN_DTYPES, DEVICE, check, rand


@pytest.fixture(autouse=True, params=["exact", "fast"])
def route(request):
    """Every test on both routes: the exact one (muser/ops/triton/softmax.py, the default) and
    the fastest launch's (the `exact` switch off)."""
    with switched(exact=request.param == "exact"):
        yield request.param


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


def _in_place(gen, dtype, heads, kv_heads, head_dim, tile, num_q, num_prev, window, scale,
              seed, config=None):
    """A chunk at depth attending the store where its rows are (read_rows: pages of two tiles
    in a random order) against the float64 dense reference of the same rows gathered."""
    num_k, page = num_prev + num_q, 2 * tile
    pages = 2 * -(-num_k // page)
    k_store = rand(gen, pages * page, kv_heads, head_dim, dtype=dtype)
    v_store = rand(gen, pages * page, kv_heads, head_dim, dtype=dtype)
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(num_k)
    read = order[pos // page] * page + pos % page
    q = rand(gen, num_q, heads, head_dim)
    tiles = classify_tiles(num_prev, num_q, 0, num_k, window, tile, tile)
    out = prefill_attention(q, k_store, v_store, num_prev, 0, window, scale, tiles.to(DEVICE),
                            tile, Route.TILED, read_rows=read.to(DEVICE), config=config)
    expect = attention_dense(q.cpu().double(), k_store.cpu()[read].double(),
                             v_store.cpu()[read].double(), torch.arange(num_prev, num_k),
                             torch.arange(num_k), window, scale, torch.float64)
    check(out.float(), expect, dtype)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("splits,pack,wide", [(1, 1, 1), (3, 1, 2), (4, 2, 2), (1, 2, 1),
                                              (1, 2, 2)])
@pytest.mark.parametrize("num_q,num_prev,window", [(40, 120, None), (33, 70, 48)])
def test_flash_in_place_and_split(gen, dtype, splits, pack, wide, num_q, num_prev, window):
    """A chunk at depth attends the store in place (_in_place), its key range split over
    several programs whose partials are combined, two query heads of a key/value head in one
    program (pack), the FULL tiles two at a time (wide: each tile's rows from its own first
    row, so a pair may straddle pages)."""
    _in_place(gen, dtype, 4, 2, 64, 16, num_q, num_prev, window, 0.125, num_q,
              FlashConfig(splits=splits, pack=pack, wide=wide))


def test_launch_rule_splits_only_deep_narrow_chunks():
    """The rule splits a chunk's keys when its (query tile, head) grid is small and the key
    range long, never a first chunk of the same width; it packs two query heads of a
    key/value head where head_dim allows."""
    assert launch_config(8, 4, 1, 8, 256, 64).splits == 1  # 512 rows, nothing before them
    assert launch_config(8, 4, 1, 2048, 256, 64).splits > 1  # 131k keys, gemma3-1b's 4 heads
    deep = launch_config(8, 32, 16, 2048, 128, 64)  # gemma3-27b: 32 heads over 16 kv heads
    assert deep.pack == 2 and deep.splits <= 2


def test_launch_rule_fits_shared_memory():
    """bfloat16 keys keep the measured configs (two heads a program at head_dim 128, three
    stages at 256); float32 keys (--dtype float32) take one head a program, and fewer stages
    where three buffers would not fit: every config the rule picks fits an SM's shared memory
    by the kernel's count (458,752 bytes asked at float32, pack 2, in place: the error that
    a launch then raised)."""
    bf16_27b = launch_config(8, 32, 16, 64, 128, 64, True)
    assert (bf16_27b.pack, bf16_27b.wide, bf16_27b.num_stages) == (2, 2, 5)
    assert launch_config(8, 4, 1, 64, 256, 64, False).num_stages == 3
    assert shared_bytes(2, 2, 5, 128, 64, 4) == 458752
    f32_27b = launch_config(8, 32, 16, 64, 128, 64, True, itemsize=4)
    assert (f32_27b.pack, f32_27b.wide, f32_27b.num_stages) == (1, 1, 3)
    assert launch_config(8, 4, 1, 64, 256, 64, True, itemsize=4).num_stages == 1
    for heads, kv_heads, dim in [(32, 16, 128), (4, 1, 256), (8, 4, 256), (2, 1, 128)]:
        for in_place in (False, True):
            for itemsize in (2, 4):
                c = launch_config(8, heads, kv_heads, 64, dim, 64, in_place, itemsize)
                assert shared_bytes(c.pack, c.wide, c.num_stages, dim, 64, itemsize) <= SHARED


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 128), (4, 1, 256)])
def test_flash_float32_at_model_widths(gen, heads, kv_heads, head_dim):
    """float32 keys and values (--dtype float32 on a GPU) at gemma3-27b's and -1b's head widths
    in 64-row tiles, in place (_in_place), with the launch rule's own config: within the
    float32 bound."""
    _in_place(gen, torch.float32, heads, kv_heads, head_dim, 64, 70, 60, None, 0.0625, head_dim)


@pytest.mark.parametrize("q_start,num_q,k_start,num_k,window",
                         [(96, 50, 0, 146, None), (40, 80, 9, 111, 32), (0, 64, 0, 64, 16),
                          (500, 70, 0, 570, 100), (0, 1, 0, 1, None)])
def test_classifier_ranges_are_the_tiles_runs(q_start, num_q, k_start, num_k, window):
    """Per query tile: [first, last + 1) spans exactly its non-empty key tiles and
    [full_first, full_last + 1) exactly its FULL ones, inside it (the kernel's three loops
    cover the range once, the middle one without a mask)."""
    from muser.ops.tiles import EMPTY, FULL
    from muser.ops.triton.prefill_attention import classifier_ranges

    tiles = classify_tiles(q_start, num_q, k_start, num_k, window, 16, 16)
    for row, (first, full_first, full_last, last) in zip(tiles, classifier_ranges(tiles).tolist()):
        nonempty = (row != EMPTY).nonzero().flatten().tolist()
        full = (row == FULL).nonzero().flatten().tolist()
        assert list(range(first, last)) == nonempty
        assert first <= full_first <= full_last <= last
        assert list(range(full_first, full_last)) == full
