"""The CPU backend's C kernels: each against float64 within an error bound derived next to it,
and each bitwise the same however its rows are grouped — decode rows in place on rings
(wrapped or not) and pages, prefill chunks of any width, the staging shadow."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from muser.ops import cpu, native, ref
from muser.ops.dense_ref import attention_dense
from muser.ops.packed import PackedMatrix
from tests.error_bounds import U, attention_bound, gamma
from tests.test_packed import QT, _packed


def _bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """attention_bound of one query row per head over all of k (attention.c: the scaling, then
    16-lane FMA chains of D / 16 steps and a 4-level tree: D / 16 + 5 roundings)."""
    visible = torch.ones(1, k.shape[0], dtype=torch.bool)
    return attention_bound(q[None], k, v, scale, visible, q.shape[-1] // 16 + 5)[0]


def _float64(q, k, v, scale):
    pos = torch.arange(k.shape[0])
    return attention_dense(q[None].double(), k.double(), v.double(), pos[-1:], pos, None,
                           scale, torch.float64)[0]


def _rings(gen: torch.Generator, dtype: torch.dtype):
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


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("make", [_rings, _pages], ids=["rings", "pages"])
def test_decode_attention_in_place_equals_gathered_keys(dtype, make, threads):
    """Keys read in place through the block table give the bits of the same keys gathered
    into logical order, and both are within the error bound of float64, whether each thread
    takes whole sequences (fewer threads than sequences) or the threads share each."""
    args = make(torch.Generator().manual_seed(0), dtype)
    q, k_rows, v_rows, table, starts, lens, origins, block_size, scale = args
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = cpu.decode_attention(*args)
    finally:
        torch.set_num_threads(before)
    for b in range(q.shape[0]):
        if lens[b] <= starts[b]:
            assert (out[b] == 0).all()
            continue
        rows = ref.decode_rows(table[b], int(starts[b]), int(lens[b]), int(origins[b]),
                               block_size)
        k, v = k_rows[rows].float(), v_rows[rows].float()
        gathered = native.attention(q[b : b + 1], k, v, len(rows) - 1, 0, None, scale)[0]
        assert torch.equal(out[b], gathered)
        err = (out[b].double() - _float64(q[b], k, v, scale)).abs()
        assert (err <= _bound(q[b], k, v, scale)).all()


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_rows_equal_decode_rows(window):
    """A chunk's query rows, computed together in one call, one by one as decode steps, or
    from a staging shadow at another offset, are bitwise the same."""
    gen = torch.Generator().manual_seed(1)
    t, heads, kv_heads, d = 23, 4, 1, 48
    keys = torch.randn(40, kv_heads, d, generator=gen)
    values = torch.randn(40, kv_heads, d, generator=gen)
    q = torch.randn(t, heads, d, generator=gen)
    q_start = 40 - t  # the chunk's rows are the last t keys
    chunk = cpu.prefill_attention(q, keys, values, q_start, 0, window, 0.2, None, 0, None)
    for i in range(t):
        pos = q_start + i
        first = 0 if window is None else max(0, pos - window + 1)
        one = native.attention(q[i : i + 1], keys, values, pos, first, None, 0.2)[0]
        assert torch.equal(chunk[i], one)
        shadow = cpu.prefill_attention(q[i : i + 1], keys[first : pos + 1],
                                       values[first : pos + 1], pos, first, window, 0.2, None,
                                       0, None)[0]
        assert torch.equal(chunk[i], shadow)
        err = (one.double() - _float64(q[i], keys[first:pos + 1], values[first:pos + 1],
                                       0.2)).abs()
        assert (err <= _bound(q[i], keys[first:pos + 1], values[first:pos + 1], 0.2)).all()


def _team_work() -> int:
    """attention.c's TEAM_WORK: T * H * keys * D from which the threads share one task."""
    text = (Path(native.__file__).parent / "attention.c").read_text()
    return 1 << int(re.search(r"#define TEAM_WORK \(1 << (\d+)\)", text)[1])


@pytest.mark.parametrize("heads, kv_heads, d, window", [
    (4, 1, 256, None), (4, 1, 256, 100), (8, 2, 64, None), (2, 1, 256, None)])
def test_decode_row_shared_by_threads(heads, kv_heads, d, window):
    """A decode row over enough keys is shared by the threads (the keys split for the scores,
    the heads for the softmax, the head dims for the values): the bits of the same row on one
    thread and inside a prefill chunk, within the error bound of float64."""
    gen = torch.Generator().manual_seed(heads * d)
    keys = 600
    assert heads * keys * d >= _team_work()  # the shapes form a team
    k = torch.randn(keys, kv_heads, d, generator=gen)
    v = torch.randn(keys, kv_heads, d, generator=gen)
    q = torch.randn(3, heads, d, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        chunk = native.attention(q, k, v, keys - 3, 0, window, 0.1)
        alone = [native.attention(q[i : i + 1], k, v, keys - 3 + i, 0, window, 0.1)
                 for i in range(3)]
        for team in (2, 4):  # 4 threads over kv_heads = 2 tasks: each task shared
            torch.set_num_threads(team)
            for i in range(3):
                row = native.attention(q[i : i + 1], k, v, keys - 3 + i, 0, window, 0.1)
                assert torch.equal(row, alone[i]) and torch.equal(row[0], chunk[i])
    finally:
        torch.set_num_threads(threads)
    first = 0 if window is None else keys - window
    for h in range(0, heads, kv_heads):  # one head of each KV head's group
        kv = h * kv_heads // heads
        seen = slice(first, keys)
        got = alone[-1][0, h : h + 1]
        expect = _float64(q[-1, h : h + 1], k[seen, kv : kv + 1], v[seen, kv : kv + 1], 0.1)
        bound = _bound(q[-1, h : h + 1], k[seen, kv : kv + 1], v[seen, kv : kv + 1], 0.1)
        assert ((got.double() - expect).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_keys_widened_in_the_kernel(dtype):
    """16-bit key and value rows read by the kernel give the bits of the same rows widened to
    float32 first (widening is exact): a chunk, a decode row the threads share, a sliding
    window, and the prefill path over a 16-bit cache."""
    gen = torch.Generator().manual_seed(5)
    keys, heads, d = 600, 4, 64
    k = torch.randn(keys, 1, d, generator=gen).to(dtype)
    v = torch.randn(keys, 1, d, generator=gen).to(dtype)
    q = torch.randn(9, heads, d, generator=gen)
    for rows, window in ((q, None), (q[:1], None), (q, 100)):
        narrow = native.attention(rows, k, v, keys - rows.shape[0], 0, window, 0.1)
        wide = native.attention(rows, k.float(), v.float(), keys - rows.shape[0], 0, window, 0.1)
        assert torch.equal(narrow, wide)
    chunk = cpu.prefill_attention(q, k, v, keys - 9, 0, None, 0.1, None, 0, None)
    assert torch.equal(chunk, native.attention(q, k.float(), v.float(), keys - 9, 0, None, 0.1))


def norm_bound(y: torch.Tensor, d: int) -> torch.Tensor:
    """|dy| for y = x * (1 / sqrt(sum(x^2) / d + eps)) * w: the sum of squares (positive terms)
    in 16 lanes and a tree, gamma(d / 16 + 5) relative; /d, +eps, sqrt, 1/: 4 roundings, the
    square root halving the sum's error; two products: 2. Relative
    gamma(d / 16 + 5) / 2 + gamma(6), with margin gamma(d / 16 + 12)."""
    return gamma(d // 16 + 12) * y.abs()


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_norms_within_their_error_bound_and_row_independent(rows):
    gen = torch.Generator().manual_seed(rows)
    res = torch.randn(rows, 640, generator=gen) * 3
    x = torch.randn(rows, 640, generator=gen)
    post, nxt = 1 + 0.1 * torch.randn(640, generator=gen), 1 + 0.1 * torch.randn(640, generator=gen)
    h, y = native.add_rms_norm(res, x, post, nxt, 1e-6)
    h64, _ = ref.add_rms_norm(res.double(), x.double(), post.double(), nxt.double(), 1e-6)
    normed = ref.rms_norm(x.double(), post.double(), 1e-6)
    # h = res + normed (normed within its bound, then one addition)
    assert ((h.double() - h64).abs() <= norm_bound(normed, 640) + U * h64.abs()).all()
    # y normalizes the computed h: bound y of h itself
    y_of_h = ref.rms_norm(h.double(), nxt.double(), 1e-6)
    assert ((y.double() - y_of_h).abs() <= norm_bound(y_of_h, 640)).all()
    strided = torch.randn(rows, 1000, generator=gen)[:, :640]  # rows 1000 apart
    expect = ref.rms_norm(strided.double(), nxt.double(), 1e-6)
    got = native.rms_norm(strided, nxt, 1e-6)
    assert ((got.double() - expect).abs() <= norm_bound(expect, 640)).all()
    assert torch.equal(native.rms_norm(strided[-1:], nxt, 1e-6), got[-1:])
    h1, y1 = native.add_rms_norm(res[-1:], x[-1:], post, nxt, 1e-6)
    assert torch.equal(h1, h[-1:]) and torch.equal(y1, y[-1:])


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_qk_norm_rope_within_its_error_bound(rows):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 6 * 256, generator=gen)
    q = qkv[:, : 4 * 256].view(rows, 4, 256)  # a strided view, as the decoder passes it
    w = 1 + 0.1 * torch.randn(256, generator=gen)
    cos, sin = cpu.rope_cos_sin(torch.arange(100, 100 + rows), 256, 10_000.0)
    out = native.qk_norm_rope(q, w, cos, sin, 1e-6)
    normed = ref.rms_norm(q.double(), w.double(), 1e-6)
    expect = ref.qk_norm_rope(q.double(), w.double(), cos.double(), sin.double(), 1e-6)
    # rotation: each half is x1 c - x2 s of normed values (their bound) and two products and
    # a difference (3 roundings of magnitudes |x1 c| + |x2 s| <= |x1| + |x2|)
    half = 128
    mag = normed[..., :half].abs() + normed[..., half:].abs()
    bound = (norm_bound(torch.ones(1), 256) + gamma(3)) * torch.cat((mag, mag), -1)
    assert out.is_contiguous() and ((out.double() - expect).abs() <= bound).all()
    assert torch.equal(native.qk_norm_rope(q[-1:], w, cos[-1:], sin[-1:], 1e-6), out[-1:])


def test_rope_angles_are_libm_of_the_float32_angle():
    """cos / sin of float(p) * inv_freq (HF's float32 angle): libm's cosf / sinf are within
    one ulp, |dcos| <= 2^-23; each row depends on its position alone."""
    positions = torch.tensor([0, 1, 511, 512, 4097, 131071])
    cos, sin = cpu.rope_cos_sin(positions, 256, 1_000_000.0, 8.0)
    exponent = torch.arange(0, 256, 2, dtype=torch.int64).float()
    angles = (positions.float()[:, None] * (1.0 / (1_000_000.0 ** (exponent / 256)) / 8.0))
    assert (cos.double() - angles.double().cos()).abs().max() <= 2.0**-23
    assert (sin.double() - angles.double().sin()).abs().max() <= 2.0**-23
    one = cpu.rope_cos_sin(positions[3:4], 256, 1_000_000.0, 8.0)
    assert torch.equal(one[0], cos[3:4]) and torch.equal(one[1], sin[3:4])


def test_geglu_within_its_error_bound():
    """gelu_tanh(g) u with tanh(a) = 1 - 2 / (exp(2a) + 1): muser_exp's ~1 ulp (4u with
    margin), +1, /, 1 - : |dtanh| <= 2 (4u + 2u) + u = 13u absolute; then 0.5 g (1 + t) u:
    |dy| <= 0.5 |g u| 13u + gamma(5) |y| for the argument's and the products' roundings (the
    argument's relative error moves tanh by at most as much, |tanh'| <= 1, times |g| k0)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 2 * 200, generator=gen) * 3
    y = native.geglu(x)
    g, u = x.double().chunk(2, -1)
    inner = math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)
    y64 = 0.5 * g * (1 + torch.tanh(inner)) * u
    bound = 0.5 * (g * u).abs() * (13 * U + gamma(6) * inner.abs()) + gamma(5) * y64.abs()
    assert ((y.double() - y64).abs() <= bound).all()
    assert torch.equal(native.geglu(x[5:6]), y[5:6])


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


MARCHES = ["x86-64", "haswell"]


@pytest.fixture(scope="module")
def variant_builds(tmp_path_factory):
    """march -> (compiler process, its library) of test_other_builds_compute_the_same_bits,
    both started on first use: each build is one single-threaded compiler run of about a
    minute, so the two run side by side rather than one after the other."""
    import os
    import platform
    import subprocess

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 variants")
    directory = tmp_path_factory.mktemp("variants")
    cc = os.environ.get("CC", "cc")
    builds = {}
    for march in MARCHES:
        flags = [f for f in native.FLAGS if not f.startswith("-march")] + [f"-march={march}"]
        target = directory / f"variant-{march}.so"
        proc = subprocess.Popen([cc, *flags, "-o", str(target), *map(str, native.SOURCES), "-lm"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        builds[march] = proc, target
    yield builds
    for proc, _ in builds.values():
        if proc.poll() is None:  # a test that did not wait for it (failed or deselected)
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("march", MARCHES, ids=["portable", "avx2"])
def test_other_builds_compute_the_same_bits(march, variant_builds, monkeypatch):
    """The portable (one fmaf per lane) and AVX2 builds of the kernels give the bits of this
    machine's build: every step is one correctly rounded IEEE operation per lane."""
    import ctypes

    main = native.library()
    proc, target = variant_builds[march]
    _, stderr = proc.communicate()
    assert proc.returncode == 0, stderr
    variant = ctypes.CDLL(str(target))
    for name in ("muser_gemm", "muser_attention", "muser_rms_norm", "muser_geglu"):
        getattr(variant, name).argtypes = getattr(main, name).argtypes
        getattr(variant, name).restype = getattr(main, name).restype
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 256, generator=gen)
    q, k = torch.randn(9, 4, 64, generator=gen), torch.randn(50, 1, 64, generator=gen)
    long = torch.randn(600, 1, 64, generator=gen)  # a decode row the threads share
    # float32 values, and codes with float16 scales (Q8_0), float32 scales and mins (Q4_K)
    # and float32 scales alone (Q6_K): each build's tiles at every width it has
    mats = [PackedMatrix.from_dense(torch.randn(70, 256, generator=gen))] + [
        _packed(qtype, 70, 256, seed) for seed, qtype in enumerate(
            (QT.Q8_0, QT.Q4_K, QT.Q6_K))]
    widths = (1, 2, 3, 5, 8, 12, 16, 37)

    def outputs() -> list[torch.Tensor]:
        return [native.gemm(x[:n], w) for w in mats for n in widths] + [
            native.rms_norm(x, x[0], 1e-6), native.geglu(x),
            native.attention(q, k, k, 41, 0, 16, 0.1),  # 4 heads on a KV head, D = 64
            native.attention(q.reshape(9, 1, 256), k.repeat(1, 1, 4), k.repeat(1, 1, 4), 41, 0,
                             0, 0.1),  # one head, D = 256
            native.attention(q[:1], long, long, 599, 0, 0, 0.1)]

    ours = outputs()
    monkeypatch.setattr(native, "library", lambda: variant)
    assert all(torch.equal(a, b) for a, b in zip(ours, outputs()))


@pytest.mark.parametrize("march", MARCHES, ids=["portable", "avx2"])
def test_other_builds_unpack_narrow_codes_to_the_same_bits(march, variant_builds,
                                                           monkeypatch):
    """Codes held at 4 bits (Q4_K) and 5 bits (Q5_0) unpack to the same integers in the
    portable and AVX2 builds as in this machine's: the same GEMM bits at every width."""
    import ctypes

    main = native.library()
    proc, target = variant_builds[march]
    _, stderr = proc.communicate()
    assert proc.returncode == 0, stderr
    variant = ctypes.CDLL(str(target))
    variant.muser_gemm.argtypes = main.muser_gemm.argtypes
    variant.muser_gemm.restype = main.muser_gemm.restype
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 256, generator=gen)
    mats = [_packed(qtype, 70, 256, seed) for seed, qtype in enumerate((QT.Q4_K, QT.Q5_0))]
    assert [m.bits for m in mats] == [4, 5]

    def outputs() -> list[torch.Tensor]:
        return [native.gemm(x[:n], w) for w in mats for n in (1, 2, 3, 5, 8, 12, 16, 37)]

    ours = outputs()
    monkeypatch.setattr(native, "library", lambda: variant)
    assert all(torch.equal(a, b) for a, b in zip(ours, outputs()))
