"""The CPU backend's own decode attention (keys read in place) against the reference spec and
float64, on rings wrapped and not, windows that start mid-ring, scattered and consecutive
pages, and padding rows."""

from __future__ import annotations

import pytest
import torch

from muser.attention.dense_ref import attention_dense
from muser.ops import cpu, ref


def _case(gen: torch.Generator, dtype: torch.dtype):
    cap, heads, kv_heads, d = 40, 6, 2, 64
    k_rows = torch.randn(4 * cap, kv_heads, d, generator=gen).to(dtype)
    v_rows = torch.randn(4 * cap, kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(4, heads, d, generator=gen)
    # ring slots: full and wrapped (origin 13), partial, window start mid-ring, padding
    table = torch.tensor([[2], [0], [3], [1]], dtype=torch.int32)
    starts = torch.tensor([0, 0, 25, 0], dtype=torch.int32)
    lens = torch.tensor([cap, 17, 60, 0], dtype=torch.int32)
    origins = torch.tensor([13, 0, 7, 0], dtype=torch.int32)
    return q, k_rows, v_rows, table, starts, lens, origins, cap, d**-0.5


def _pages(gen: torch.Generator, dtype: torch.dtype):
    heads, kv_heads, d = 4, 1, 32
    k_rows = torch.randn(96, kv_heads, d, generator=gen).to(dtype)
    v_rows = torch.randn(96, kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(3, heads, d, generator=gen)
    table = torch.tensor([[5, 0, 3], [1, 2, 3], [4, 0, 0]], dtype=torch.int32)  # scattered,
    z = torch.zeros(3, dtype=torch.int32)  # consecutive, one page
    lens = torch.tensor([45, 40, 1], dtype=torch.int32)
    return q, k_rows, v_rows, table, z, lens, z, 16, d**-0.5


def test_physical_runs_match_decode_rows():
    for table, start, length, origin, bs in [([0], 0, 40, 13, 40), ([2], 25, 60, 7, 40),
                                             ([5, 0, 3], 0, 45, 0, 16), ([1, 2, 3], 3, 40, 0, 16)]:
        rows = ref.decode_rows(torch.tensor(table), start, length, origin, bs).tolist()
        runs = cpu.physical_runs(table, start, length, origin, bs)
        assert [r for a, b in runs for r in range(a, b)] == rows


def _float64(q, k_rows, v_rows, table, starts, lens, origins, block_size, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        if lens[b] <= starts[b]:
            continue
        rows = ref.decode_rows(table[b], int(starts[b]), int(lens[b]), int(origins[b]),
                               block_size)
        pos = torch.arange(len(rows))
        out[b] = attention_dense(q[b : b + 1].double(), k_rows[rows].double(),
                                 v_rows[rows].double(), pos[-1:], pos, None, scale,
                                 torch.float64)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("make", [_case, _pages], ids=["rings", "pages"])
def test_decode_attention_matches_reference(dtype, make):
    args = make(torch.Generator().manual_seed(0), dtype)
    out = cpu.decode_attention(*args)
    assert (out.double() - _float64(*args)).abs().max() < 1e-5
    assert torch.allclose(out, ref.decode_attention(*args), atol=1e-6, rtol=0)
    lens, starts = args[5], args[4]
    assert (out[lens <= starts] == 0).all()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_native_norms_match_float64(rows):
    from muser.ops import native

    gen = torch.Generator().manual_seed(rows)
    res = torch.randn(rows, 640, generator=gen) * 3
    x = torch.randn(rows, 640, generator=gen)
    post, nxt = 1 + 0.1 * torch.randn(640, generator=gen), 1 + 0.1 * torch.randn(640, generator=gen)
    h, y = native.add_rms_norm(res, x, post, nxt, 1e-6)
    h64, y64 = ref.add_rms_norm(res.double(), x.double(), post.double(), nxt.double(), 1e-6)
    assert (h.double() - h64).abs().max() < 1e-5 and (y.double() - y64).abs().max() < 1e-5
    strided = torch.randn(rows, 1000, generator=gen)[:, :640]  # rows 1000 apart
    expect = ref.rms_norm(strided.double(), nxt.double(), 1e-6)
    assert (native.rms_norm(strided, nxt, 1e-6).double() - expect).abs().max() < 1e-5


@pytest.mark.parametrize("rows", [1, 5])
def test_native_qk_norm_rope_matches_float64(rows):
    from muser.ops import native

    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 6 * 256, generator=gen)
    q = qkv[:, : 4 * 256].view(rows, 4, 256)  # a strided view, as the decoder passes it
    w = 1 + 0.1 * torch.randn(256, generator=gen)
    cos, sin = ref.rope_cos_sin(torch.arange(100, 100 + rows), 256, 10_000.0)
    out = native.qk_norm_rope(q, w, cos, sin, 1e-6)
    expect = ref.qk_norm_rope(q.double(), w.double(), cos.double(), sin.double(), 1e-6)
    assert out.is_contiguous() and (out.double() - expect).abs().max() < 1e-5


def test_cpu_backend_uses_native_only_for_float32_decode_rows():
    gen = torch.Generator().manual_seed(0)
    w = 1 + 0.1 * torch.randn(64, generator=gen)
    few, many = torch.randn(2, 64, generator=gen), torch.randn(20, 64, generator=gen)
    from muser.ops import native

    assert torch.equal(cpu.rms_norm(few, w, 1e-6), native.rms_norm(few, w, 1e-6))
    assert torch.equal(cpu.rms_norm(many, w, 1e-6), ref.rms_norm(many, w, 1e-6))
    half = cpu.rms_norm(few, w, 1e-6, torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, ref.rms_norm(few, w, 1e-6,
                                                                          torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_of_decode_rows_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    k_new, v_new = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    src, dst = torch.tensor([0, 1, 2]), torch.tensor([5, -1, 0])  # a padding row stores nothing
    ours = [torch.zeros(10, 2, 8, dtype=dtype) for _ in range(2)]
    theirs = [torch.zeros(10, 2, 8, dtype=dtype) for _ in range(2)]
    cpu.store_kv(*ours, k_new, v_new, src, dst)
    ref.store_kv(*theirs, k_new, v_new, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert ours[0][5].abs().sum() > 0 and (ours[0][1:5] == 0).all()


@pytest.mark.parametrize("keys", [1, 37, 600])
def test_native_decode_attention_matches_float64(keys):
    """GQA (8 heads over 2 KV heads), keys a strided slice of a larger store."""
    from muser.ops import native

    gen = torch.Generator().manual_seed(keys)
    store_k = torch.randn(keys + 10, 2, 64, generator=gen)
    store_v = torch.randn(keys + 10, 2, 64, generator=gen)
    k, v = store_k[5 : 5 + keys], store_v[5 : 5 + keys]
    q = torch.randn(8, 64, generator=gen)
    out = native.decode_attention(q, k, v, 0.125)
    pos = torch.arange(keys)
    expect = attention_dense(q[None].double(), k.double(), v.double(), pos[-1:], pos, None,
                             0.125, torch.float64)[0]
    assert (out.double() - expect).abs().max() < 1e-5
