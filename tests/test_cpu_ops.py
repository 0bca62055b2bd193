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
