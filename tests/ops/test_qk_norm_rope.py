from __future__ import annotations

import pytest
import torch

from muser.ops import ref
from muser.ops.triton import qk_norm_rope

from opcheck import DEVICE, DTYPES, check, rand


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,heads,head_dim", [(1, 1, 64), (6, 3, 128), (4, 2, 256), (70, 4, 64)])
def test_qk_norm_rope(gen, dtype, n, heads, head_dim):
    """Up to 64 rows one head a program; (70, 4, 64): four heads a program."""
    # A strided view, as the split of the fused QKV projection hands it over.
    qkv = rand(gen, n, (heads + 2) * head_dim, dtype=dtype)
    x = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    w = 1 + rand(gen, head_dim, scale=0.1)
    positions = torch.tensor([0, 511, 512, 1023, 1027, 7][:n] + [5] * max(0, n - 6))
    cos, sin = ref.rope_cos_sin(positions.to(x.device), head_dim, 10000.0)
    out = qk_norm_rope(x, w, cos, sin, 1e-6)
    expect = ref.qk_norm_rope(x.double(), w.double(), cos.double(), sin.double(), 1e-6)
    check(out, expect, torch.float32, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [3, 66])
def test_qk_norm_rope_pair(gen, dtype, n):
    """3 rows: one head a program; 66 rows: two (every program all q's or all k's)."""
    from muser.ops.triton import qk_norm_rope_pair

    heads, kv_heads, head_dim = 4, 2, 64
    qkv = rand(gen, n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    wq, wk = 1 + rand(gen, head_dim, scale=0.1), 1 + rand(gen, head_dim, scale=0.1)
    positions = torch.randint(0, 131072, (n,), generator=gen)
    cos, sin = ref.rope_cos_sin(positions.to(q.device), head_dim, 1e6, 8.0)
    got = qk_norm_rope_pair(q, k, wq, wk, cos, sin, 1e-6)
    want = ref.qk_norm_rope_pair(q.double(), k.double(), wq.double(), wk.double(), cos.double(),
                                 sin.double(), 1e-6)
    check(got[0], want[0], torch.float32, scale=4.0)
    check(got[1], want[1], torch.float32, scale=4.0)


@pytest.mark.parametrize("head_dim,theta,scaling", [(64, 10000.0, 1.0), (256, 1e6, 8.0)])
def test_rope_cos_sin(gen, head_dim, theta, scaling):
    """The angles' cos/sin in one launch vs float64; positions up to 131,071."""
    from muser.ops.triton import rope_cos_sin

    positions = torch.randint(0, 131072, (37,), generator=gen).to(DEVICE)
    positions[:3] = torch.tensor([0, 1, 131071])
    cos, sin = rope_cos_sin(positions, head_dim, theta, scaling)
    # float64 cos/sin of the kernel's float32 angles (its float32 frequencies, computed on its
    # device: a GPU's pow may differ from the CPU's by an ulp, 5e-4 rad at position 131,071)
    from muser.ops.triton.rope import inv_freq

    inv = inv_freq(head_dim, theta, scaling, positions.device).cpu()
    angles = (positions.cpu().float()[:, None] * inv[None, :]).double()
    check(cos, angles.cos(), torch.float32)
    check(sin, angles.sin(), torch.float32)


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("n", [5, 72])
def test_qk_norm_rope_pair_store(gen, cache_dtype, n):
    """Keys returned in the cache dtype, and stored with the values at their cache rows
    (dst < 0 rows not stored; every other cache row left as it was); 72 rows: two heads a
    program."""
    from muser.ops.triton import qk_norm_rope_pair

    heads, kv_heads, head_dim, num_rows = 2, 2, 64, n + 7
    qkv = rand(gen, n, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
    wq, wk = 1 + rand(gen, head_dim, scale=0.1), 1 + rand(gen, head_dim, scale=0.1)
    cos, sin = ref.rope_cos_sin(torch.arange(3, 3 + n).to(q.device), head_dim, 1e4)
    dst = torch.randperm(num_rows, generator=gen)[:n]
    dst[1] = -1
    dst = dst.to(DEVICE)
    k_rows = rand(gen, num_rows, kv_heads, head_dim, dtype=cache_dtype)
    v_rows = rand(gen, num_rows, kv_heads, head_dim, dtype=cache_dtype)
    k_want, v_want = k_rows.cpu().double(), v_rows.cpu().double()
    got_q, got_k = qk_norm_rope_pair(q, k, wq, wk, cos, sin, 1e-6, cache_dtype,
                                     (k_rows, v_rows, v, dst))
    want_q, want_k = ref.qk_norm_rope_pair(  # on the CPU, where the expected rows are
        q.cpu().double(), k.cpu().double(), wq.cpu().double(), wk.cpu().double(),
        cos.cpu().double(), sin.cpu().double(), 1e-6, torch.float64,
        (k_want, v_want, v.cpu().double(), dst.cpu()))
    assert got_k.dtype == cache_dtype
    check(got_q, want_q, torch.float32, scale=4.0)
    check(got_k, want_k, cache_dtype, scale=4.0)
    check(k_rows, k_want, cache_dtype, scale=4.0)
    check(v_rows, v_want, cache_dtype)
    untouched = [r for r in range(num_rows) if r not in dst.tolist()]
    assert torch.equal(k_rows.cpu().double()[untouched], k_want[untouched])
