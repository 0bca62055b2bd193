from __future__ import annotations

import pytest
import torch

from muser.ops import ref
from muser.ops.dense_ref import attention_dense
from muser.ops.triton import decode_attention
from muser.ops.triton.switches import switched

from opcheck import ATTN_DTYPES, DEVICE, check, rand


@pytest.fixture(autouse=True, params=["exact", "fast"])
def route(request):
    """Every test on both routes: the exact one (muser/ops/triton/softmax.py, the default) and
    the fastest launch's (the `exact` switch off)."""
    with switched(exact=request.param == "exact"):
        yield request.param


def _reference(q, k_rows, v_rows, table, starts, lens, origins, block_size, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        if lens[b] <= starts[b]:
            continue
        rows = ref.decode_rows(table[b].cpu(), int(starts[b]), int(lens[b]), int(origins[b]),
                               block_size)
        keys, values = k_rows.cpu()[rows].double(), v_rows.cpu()[rows].double()
        pos = torch.arange(len(rows))
        out[b] = attention_dense(q[b:b + 1].cpu().double(), keys, values, pos[-1:], pos, None,
                                 scale, torch.float64)[0]
    return out


def _three_ring_slots(cap: int) -> tuple[torch.Tensor, ...]:
    """Decode metadata of 3 ring slots of capacity `cap`: one full and wrapped (origin 13), one
    partial (17 keys), one padding row -> (table, starts, lens, origins, src, dst), dst the
    physical row of each sequence's newest key (-1 for the padding row)."""
    table = torch.tensor([[2], [0], [1]], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 0, 0], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([cap, 17, 0], dtype=torch.int32, device=DEVICE)
    origins = torch.tensor([13, 0, 0], dtype=torch.int32, device=DEVICE)
    newest = [int(ref.decode_rows(table[b].cpu(), 0, int(lens[b]), int(origins[b]), cap)[-1])
              for b in range(2)]
    src = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor(newest + [-1], dtype=torch.int32, device=DEVICE)
    return table, starts, lens, origins, src, dst


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 64), (6, 2, 128)])
def test_decode_ring_and_pages(gen, dtype, heads, kv_heads, head_dim):
    # Sliding: 3 ring slots of capacity 40, one wrapped (origin 13), one partial, one padding.
    cap = 40
    k_rows, v_rows = rand(gen, 3 * cap, kv_heads, head_dim, dtype=dtype), rand(
        gen, 3 * cap, kv_heads, head_dim, dtype=dtype)
    q = rand(gen, 3, heads, head_dim)
    table = torch.tensor([[2], [0], [1]], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 0, 0], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([cap, 17, 0], dtype=torch.int32, device=DEVICE)
    origins = torch.tensor([13, 0, 0], dtype=torch.int32, device=DEVICE)
    args = (q, k_rows, v_rows, table, starts, lens, origins, cap, head_dim**-0.5)
    out = decode_attention(*args, splits=4)
    check(out.float(), _reference(*args), dtype)
    assert (out[2] == 0).all()
    # Global: pages of 16 rows in scattered order; one sequence of 45 keys, one of 1.
    k_pages, v_pages = k_rows[:96].contiguous(), v_rows[:96].contiguous()
    table = torch.tensor([[5, 0, 3], [2, 0, 0]], dtype=torch.int32, device=DEVICE)
    z = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([45, 1], dtype=torch.int32, device=DEVICE)
    args = (q[:2], k_pages, v_pages, table, z, lens, z, 16, head_dim**-0.5)
    check(decode_attention(*args, splits=2).float(), _reference(*args), dtype)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_decode_over_a_long_page_table(gen, dtype):
    """A table of LONG_KEYS keys or more takes the long-range launch configuration (its own
    split count, 64 keys per iteration): pages in scattered order, a partial last page, and a
    sequence far shorter than the table (most splits empty)."""
    from muser.ops.triton.decode_attention import LONG_KEYS, launch_config

    bs, kv_heads, heads, head_dim = 256, 2, 4, 64
    pages = LONG_KEYS // bs
    k_rows, v_rows = (rand(gen, pages * bs, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    q = rand(gen, 2, heads, head_dim)
    order = torch.randperm(pages, generator=gen).to(torch.int32)
    table = torch.stack([order, order.flip(0)]).to(DEVICE)
    z = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([LONG_KEYS - 37, 300], dtype=torch.int32, device=DEVICE)
    assert launch_config(2, kv_heads, head_dim, LONG_KEYS)[1] == 64
    args = (q, k_rows, v_rows, table, z, lens, z, bs, head_dim**-0.5)
    check(decode_attention(*args).float(), _reference(*args), dtype)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_decode_stores_the_new_rows_first(gen, dtype):
    """new=(k, v, src, dst): the kernel stores each sequence's new row (its newest key) and
    attends it, as ref.store_kv followed by the attention over the cache."""
    cap, kv_heads, heads, head_dim = 40, 2, 4, 64
    k_rows, v_rows = (rand(gen, 3 * cap, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    q = rand(gen, 3, heads, head_dim)
    k_new, v_new = rand(gen, 3, kv_heads, head_dim), rand(gen, 3, kv_heads, head_dim)
    table, starts, lens, origins, src, dst = _three_ring_slots(cap)
    k_want, v_want = k_rows.clone(), v_rows.clone()
    ref.store_kv(k_want, v_want, k_new, v_new, src, dst)
    meta = (table, starts, lens, origins, cap, head_dim**-0.5)
    out = decode_attention(q, k_rows, v_rows, *meta, new=(k_new, v_new, src, dst), splits=4)
    assert torch.equal(k_rows, k_want) and torch.equal(v_rows, v_want)
    check(out.float(), _reference(q, k_want, v_want, *meta), dtype)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("length", [1, 32, 33, 64, 65, 100])
def test_new_row_at_tile_and_split_edges(gen, dtype, length):
    """The newest key read from the input wherever it falls: alone in its split (33 = 32 + 1),
    last of a whole tile (32, 64), first of a tile (65), the only key (1); 32 keys per
    iteration, pages of 16 rows in scattered order, 4 splits."""
    bs, kv_heads, heads, head_dim = 16, 2, 4, 64
    pages = 8
    k_rows, v_rows = (rand(gen, pages * bs, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    q = rand(gen, 1, heads, head_dim)
    k_new, v_new = rand(gen, 1, kv_heads, head_dim), rand(gen, 1, kv_heads, head_dim)
    table = torch.randperm(pages, generator=gen).to(torch.int32)[None].to(DEVICE)
    z = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    row = int(ref.decode_rows(table[0].cpu(), 0, length, 0, bs)[-1])
    src, dst = z, torch.tensor([row], dtype=torch.int32, device=DEVICE)
    k_want, v_want = k_rows.clone(), v_rows.clone()
    ref.store_kv(k_want, v_want, k_new, v_new, src, dst)
    meta = (table, z, lens, z, bs, head_dim**-0.5)
    out = decode_attention(q, k_rows, v_rows, *meta, new=(k_new, v_new, src, dst), splits=4,
                           block_n=32)
    assert torch.equal(k_rows, k_want) and torch.equal(v_rows, v_want)
    check(out.float(), _reference(q, k_want, v_want, *meta), dtype)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_gives_raw_rows_qk_norm_and_rope(gen, dtype, head_dim, route):
    """norm_rope: q and the new keys straight from the QKV projection (a strided view of it),
    normalized and rotated inside the kernel: the stored keys and the output as the float64
    qk_norm_rope_pair followed by the attention; a padding row stores nothing. The fast route
    only: the exact one refuses raw rows (decode_norm_rope() is False there, so the decoder
    normalizes them with qk_norm_rope_pair first)."""
    cap, kv_heads, heads = 40, 2, 4
    k_rows, v_rows = (rand(gen, 3 * cap, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    qkv = rand(gen, 3, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=3.0)
    q = qkv[:, :heads * head_dim].view(3, heads, head_dim)
    k_new = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(3, kv_heads, head_dim)
    v_new = qkv[:, (heads + kv_heads) * head_dim:].view(3, kv_heads, head_dim)
    wq, wk = 1 + rand(gen, head_dim, scale=0.1), 1 + rand(gen, head_dim, scale=0.1)
    positions = torch.tensor([39, 16, 0], device=DEVICE)
    cos, sin = ref.rope_cos_sin(positions, head_dim, 1e6, 8.0)
    table, starts, lens, origins, src, dst = _three_ring_slots(cap)
    q_want, k_want = ref.qk_norm_rope_pair(q.double(), k_new.double(), wq.double(), wk.double(),
                                           cos.double(), sin.double(), 1e-6)
    k_rows_want, v_rows_want = k_rows.double(), v_rows.double()
    ref.store_kv(k_rows_want, v_rows_want, k_want, v_new.double(), src, dst)
    meta = (table, starts, lens, origins, cap, head_dim**-0.5)
    if route == "exact":
        with pytest.raises(AssertionError, match="normalizes q and k before attention"):
            decode_attention(q, k_rows, v_rows, *meta, new=(k_new, v_new, src, dst),
                             norm_rope=(wq, wk, cos, sin, 1e-6))
        return
    out = decode_attention(q, k_rows, v_rows, *meta, new=(k_new, v_new, src, dst), splits=4,
                           norm_rope=(wq, wk, cos, sin, 1e-6))
    check(k_rows, k_rows_want, dtype, scale=4.0)
    assert torch.equal(v_rows.double(), v_rows_want)
    check(out.float(), _reference(q_want, k_rows_want, v_rows_want, *meta), dtype)
    assert (out[2] == 0).all()
