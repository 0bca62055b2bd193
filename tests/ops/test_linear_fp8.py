"""FP8 projections (Fp8Matrix weights) vs float64 references of the dequantized weights: the
decode GEMV in every config and epilogue, the dequantize kernel, the two prefill routes, and
the public ops' dispatch. The GEMV and the dequant route compute on the weights' exact values
(data * scale), so they meet opcheck's bound for one output rounding and a float32 sum; the
scaled_mm route also quantizes x per token, within 2^-4 of |x| per element (tests/test_fp8.py),
so within 2^-4 * sum_k |x w| of the float64 product."""

from __future__ import annotations

import pytest
import torch

from muser.ops import ref
from muser.ops.fp8 import FP8, Fp8Matrix, quantize_activations, quantize_fp8
from muser.ops.triton import linear, linear_add_rms_norm, linear_geglu

from opcheck import DEVICE, DTYPES, check, rand

NAN_CODES = (0x7F, 0xFF)


def _weight(gen, m: int, k: int, dtype) -> Fp8Matrix:
    return quantize_fp8(rand(gen, m, k, scale=0.07), dtype)


def _proj(x: torch.Tensor, w: Fp8Matrix) -> torch.Tensor:
    """float64 x (rounded to the weight dtype first) @ the exact dequantized weights, rounded
    to the weight dtype as every projection's output is."""
    return (x.to(w.dtype).double() @ w.dequantize(torch.float64).t()).to(w.dtype).double()


def x_hat_dot8(x: torch.Tensor, config) -> torch.Tensor:
    """x as the "dot8" GEMV loop sees it (gemv_fp8's docstring): per row and per split of K,
    times the power of two up that puts the largest |x| in [2^7, 2^8), rounded to e4m3
    (torch's conversion: nearest, ties to even), divided by up."""
    from muser.ops.triton.launch import cdiv

    k = x.shape[1]
    per = cdiv(cdiv(k, config.split_k), config.block_k) * config.block_k
    out = torch.empty_like(x, dtype=torch.float64)
    for lo in range(0, k, per):
        part = x[:, lo:lo + per].double()
        amax = part.abs().amax(dim=1, keepdim=True)
        up = torch.where(amax > 0, 2.0 ** (7 - torch.floor(torch.log2(amax))), 1.0)
        out[:, lo:lo + per] = (part * up).float().to(FP8).double() / up
    return out


def _picked_proj(x: torch.Tensor, w: Fp8Matrix, epilogue: str) -> torch.Tensor:
    """_proj of x as the projection linear_fp8 picked for this shape computes on: x_hat of a
    "dot8" GEMV config or x quantized per token for "scaled_mm" (a GPU may pick either), x
    itself otherwise."""
    from muser.ops.triton.linear import _key
    from muser.ops.triton.linear_fp8 import PICKS

    pick = PICKS.pick[_key(x, w, epilogue)]
    if getattr(pick, "kind", None) == "dot8":
        return _proj(x_hat_dot8(x.to(w.dtype), pick), w)
    if pick == "scaled_mm":  # x quantized per token
        return _proj(quantize_activations(x.to(w.dtype)).dequantize(torch.float64), w)
    return _proj(x, w)


def _magnitude(x: torch.Tensor, w: Fp8Matrix) -> float:
    """max over outputs of sum_k |x w|: what a float32 sum's and a weight rounding's errors
    scale with."""
    return float((x.double().abs() @ w.dequantize(torch.float64).abs().t()).max())


def _check_quantized_x(out: torch.Tensor, x: torch.Tensor, w: Fp8Matrix) -> None:
    """out of the scaled_mm route: within the activation quantization's 2^-4 * sum_k |x w|
    of the float64 product of x and the exact weights, plus the output's rounding."""
    exact = (x.to(w.dtype).double() @ w.dequantize(torch.float64).t()).cpu()
    err = (out.double().cpu() - exact).abs()
    assert (err <= 2.0**-4 * _magnitude(x, w) + 2.0**-8 * exact.abs()).all()


def test_dequantize_every_code(gen):
    """Every e4m3 code but the two NaNs (which no quantized weight holds: quantize_fp8 clamps
    to +-448; the interpreter reads them as finite numbers), times its row's scale."""
    from muser.ops.triton.dequantize_fp8 import dequantize_fp8

    codes = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)
    for dtype in DTYPES:
        data = codes.view(FP8).reshape(2, 127).to(DEVICE)
        w = Fp8Matrix(data, rand(gen, 2).abs() + 0.5, dtype)
        assert torch.equal(dequantize_fp8(w), w.dequantize(dtype))


@pytest.mark.parametrize("epilogue", ["plain", "geglu", "norm"])
def test_every_gemv_fp8_config(gen, epilogue):
    """Each config the GPU may pick (FMA or tensor-core loops, split over K or not), with each
    epilogue, twice in a row (the arrival counters must be left at zero)."""
    from muser.ops.triton.gemv import GemvConfig, NormEpilogue
    from muser.ops.triton.gemv_fp8 import candidates_fp8, gemv_fp8

    dtype, k, m = torch.float16, 96, 40
    x, w = rand(gen, 2, k), _weight(gen, m, k, dtype)
    proj = _proj(x, w)
    res, post, nxt = rand(gen, 2, m), rand(gen, m, scale=0.5) + 1, rand(gen, m, scale=0.5) + 1
    norm = NormEpilogue(res, post, nxt, 1e-6, dtype) if epilogue == "norm" else None
    configs = candidates_fp8(2, m, k) + [GemvConfig("fma", 4, 32, 3, 4),
                                         GemvConfig("dot", 16, 32, 2, 4),
                                         GemvConfig("dot8", 16, 32, 2, 4),
                                         GemvConfig("row", 8, 32, 2, 4),
                                         GemvConfig("row", 16, 64, 1, 4, 1)]
    assert {c.kind for c in configs} == {"fma", "dot", "dot8", "row"}
    for config in configs:
        rows = 1 if config.kind == "row" else 2  # the row loop reads one row of x
        want_proj = (_proj(x_hat_dot8(x.to(dtype), config), w) if config.kind == "dot8"
                     else proj)[:rows]
        ep = None if norm is None else NormEpilogue(res[:rows], post, nxt, 1e-6, dtype)
        for _ in range(2):
            out = gemv_fp8(x[:rows], w, config, epilogue == "geglu", ep)
            if epilogue == "plain":
                check(out, want_proj, dtype)
            elif epilogue == "geglu":
                check(out, ref.geglu(want_proj), dtype, scale=2.0)
            else:
                want = ref.add_rms_norm(res[:rows].double(), want_proj, post.double(),
                                        nxt.double(), 1e-6)
                check(out[0], want[0], dtype, scale=2.0)
                check(out[1], want[1], dtype, scale=2.0)


def test_row_tiles_of_256_columns(gen):
    """Where 256 divides K and 512 does not, the row loop's candidates add 256-column tiles
    (every stage count, split over K or not): each computes the projection of one row."""
    from muser.ops.triton.gemv_fp8 import gemv_fp8, row_candidates

    dtype, k, m = torch.float16, 768, 40
    x, w = rand(gen, 1, k), _weight(gen, m, k, dtype)
    configs = [c for c in row_candidates(m, k) if c.block_k == 256]
    assert {(c.block_m, c.num_stages) for c in configs} == {
        (bm, st) for bm in (16, 32) for st in (1, 3, 5)}
    assert {c.split_k for c in configs} == {1, 2, 3}
    assert not [c for c in row_candidates(m, 1024) if c.block_k == 256]
    for config in configs:
        check(gemv_fp8(x, w, config), _proj(x, w), dtype)


@pytest.mark.parametrize("ahead", [1, 2])
def test_row_loop_with_tiles_ahead(gen, monkeypatch, ahead):
    """With one or two weight tiles loaded before the row loop's wait (gemv_fp8.AHEAD), each
    program's K range of one to five tiles, a partial last one among them, is read once: the
    tiles ahead masked off past the range, the loop starting after them."""
    from muser.ops.triton import gemv_fp8 as module
    from muser.ops.triton.gemv import GemvConfig

    monkeypatch.setattr(module, "AHEAD", ahead)
    dtype, m = torch.float16, 24
    for k in (32, 64, 96, 136, 160):  # K ranges of 1, 2, 3, 4 (the last partial) and 5 tiles
        x, w = rand(gen, 1, k), _weight(gen, m, k, dtype)
        for split_k in (1, 2):
            check(module.gemv_fp8(x, w, GemvConfig("row", 8, 32, split_k, 4, 1)), _proj(x, w),
                  dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_rows_equals_quantize_activations(gen, dtype):
    """The activation-quantization kernels of the scaled_mm route, bit for bit the reference's
    codes and scales: rows read in one block and in several, a zero row, a row of one huge
    entry, ties, a row whose largest |x| is just above 448 times a power of two (its scale
    doubles) and one just below."""
    from muser.ops.triton.quantize_fp8 import launch_rule, quantize_rows_fp8

    x = rand(gen, 5, 2500)
    x[1] = 0.0
    x[2, 7] = 3e4
    x[3] = torch.arange(2500, device=x.device) / 8 - 150  # many values at ties of e4m3
    x[4, 11] = 448.0 * 2.0**-5 * (1 + 2.0**-10)
    x = x.to(dtype)
    x = torch.cat([x, x[4:] * (1 - 2.0**-9)])
    want = quantize_activations(x)
    assert want.scales[4] == 2 * want.scales[5]
    # the launch rule's blocks (1,024 values), the whole row in one block, blocks of 256
    for rule in (launch_rule, lambda k: (4096, 4), lambda k: (256, 2)):
        got = quantize_rows_fp8(x, rule)
        assert torch.equal(got.scales, want.scales)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))


def test_quantize_rows_rounds_every_tie_and_neighbour():
    """A row whose largest |x| is 448 has scale 1, so its codes are the e4m3 roundings of x
    itself: every midpoint between neighbouring e4m3 values (ties go to even), the float32
    values on either side of each, both signs, against torch's conversion."""
    from muser.ops.triton.quantize_fp8 import quantize_rows_fp8

    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448, ascending
    mids = (codes[:-1] + codes[1:]) / 2
    vals = torch.cat([codes, mids, torch.nextafter(mids, codes[1:]),
                      torch.nextafter(mids, codes[:-1])])
    row = torch.cat([vals, -vals]).to(DEVICE)[None, :]
    got = quantize_rows_fp8(row)
    assert got.scales.item() == 1.0
    assert torch.equal(got.data.view(torch.uint8).cpu(), row.cpu().to(FP8).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_quantizes_its_rows_as_quantize_activations(gen, dtype):
    """add_rms_norm(fp8_rows=True): the same output, carrying its rows quantized bit for bit
    as the reference quantizes the output (codes and scales), a zero row included; a view of
    the output carries none."""
    from muser.ops.fp8 import attached_rows
    from muser.ops.triton import add_rms_norm

    n, d = 4, 2500
    res, x = rand(gen, n, d, scale=3.0), rand(gen, n, d)
    res[2], x[2] = 0.0, 0.0
    post, nxt = 1 + rand(gen, d, scale=0.1), 1 + rand(gen, d, scale=0.1)
    h, y = add_rms_norm(res, x, post, nxt, 1e-6, dtype, fp8_rows=True)
    h_plain, y_plain = add_rms_norm(res, x, post, nxt, 1e-6, dtype)
    assert torch.equal(h, h_plain) and torch.equal(y, y_plain)
    rows, want = attached_rows(y), quantize_activations(y)
    assert rows.dtype == dtype and torch.equal(rows.scales, want.scales)
    assert torch.equal(rows.data.view(torch.uint8), want.data.view(torch.uint8))
    assert attached_rows(y_plain) is None and attached_rows(y[:2]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("i", [300, 2500])  # one block of the quantization, three
def test_geglu_quantizes_its_rows_as_quantize_activations(gen, dtype, i):
    """geglu(fp8_rows=True): the same output, carrying its rows quantized bit for bit as the
    reference quantizes the output, from the block maxima GeGLU stored (a zero row too)."""
    from muser.ops.fp8 import attached_rows
    from muser.ops.triton.geglu import geglu

    gate_up = rand(gen, 3, 2 * i, scale=2.0).to(dtype)
    gate_up[1] = 0.0
    y = geglu(gate_up, fp8_rows=True)
    assert torch.equal(y, geglu(gate_up))
    rows, want = attached_rows(y), quantize_activations(y)
    assert torch.equal(rows.scales, want.scales)
    assert torch.equal(rows.data.view(torch.uint8), want.data.view(torch.uint8))


def test_scaled_mm_takes_attached_rows(gen):
    """scaled_mm multiplies the rows hung on x (here, deliberately, another matrix's) and does
    not quantize x again."""
    from muser.ops.fp8 import attach_rows
    from muser.ops.triton.linear_fp8 import scaled_mm

    dtype = torch.bfloat16
    x, other = rand(gen, 16, 128).to(dtype), rand(gen, 16, 128).to(dtype)
    w = _weight(gen, 32, 128, dtype)
    attach_rows(x, quantize_activations(other))
    assert torch.equal(scaled_mm(x, w), scaled_mm(other, w))


def test_gemv_fp8_dot_scales_x(gen):
    """The tensor-core loop with x not float16 (float32 here; bfloat16 on the GPU): x enters
    float16 times a power of two per row. Rows far outside float16's range (1e6, 1e-9), a zero
    row, and entries 2^-35 below their row's largest all come out right. Error model
    (gemv_fp8's docstring): each x_k rounds to 11 bits (2^-11 |x_k|) or, below 2^(e-28), to
    within 2^(e-39) <= 2^-39 max|x|; then the float32 sum adds gamma_K of the magnitudes and
    the output rounds once (2^-24)."""
    from muser.ops.triton.gemv import GemvConfig
    from muser.ops.triton.gemv_fp8 import gemv_fp8
    from tests.error_bounds import gamma

    k, m = 160, 72
    x = rand(gen, 4, k)
    x[0] *= 1e6
    x[1] *= 1e-9
    x[2] = 0.0
    x[3, ::7] *= 2.0**-35
    w = _weight(gen, m, k, torch.float32)
    wd = w.dequantize(torch.float64).cpu()
    xd = x.double().cpu()
    exact = xd @ wd.t()
    amax = xd.abs().amax(dim=1, keepdim=True)
    bound = ((2.0**-11 + gamma(k)) * (xd.abs() @ wd.abs().t())
             + 2.0**-39 * amax * wd.abs().sum(dim=1)[None, :] + 2.0**-24 * exact.abs())
    for config in (GemvConfig("dot", 16, 32, 1, 4), GemvConfig("dot", 32, 64, 2, 4)):
        out = gemv_fp8(x, w, config).double().cpu()
        assert torch.isfinite(out).all() and (out[2] == 0).all()
        assert ((out - exact).abs() <= bound).all(), config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 8, 24])  # the FP8 GEMV (<= 8 rows) and the dequant route
def test_linear_fp8(gen, dtype, n):
    from muser.ops.triton.linear import _key
    from muser.ops.triton.linear_fp8 import PICKS

    x, w = rand(gen, n, 200), _weight(gen, 72, 200, dtype)
    out = linear(x, w)
    assert out.dtype == dtype and out.shape == (n, 72)
    if PICKS.pick[_key(x, w, "")] == "scaled_mm":  # picked on a GPU, for bfloat16 rows > 8
        _check_quantized_x(out, x, w)
    else:
        check(out, _picked_proj(x, w, ""), dtype, scale=max(1.0, _magnitude(x, w)))


@pytest.mark.parametrize("n", [1, 5, 17])
def test_linear_geglu_fp8(gen, n):
    dtype = torch.float16
    x, w = rand(gen, n, 96), _weight(gen, 2 * 40, 96, dtype)
    out = linear_geglu(x, w)
    check(out, ref.geglu(_picked_proj(x, w, "geglu")), dtype,
          scale=2.0 * max(1.0, _magnitude(x, w)))


@pytest.mark.parametrize("n", [1, 3, 17])
def test_linear_add_rms_norm_fp8(gen, n):
    dtype, m = torch.float16, 1100
    x, w = rand(gen, n, 96), _weight(gen, m, 96, dtype)
    res, post, nxt = rand(gen, n, m), rand(gen, m, scale=0.5) + 1, rand(gen, m, scale=0.5) + 1
    h, y = linear_add_rms_norm(x, w, res, post, nxt, 1e-6, dtype)
    h_ref, y_ref = ref.add_rms_norm(res.double(), _picked_proj(x, w, "norm"), post.double(),
                                    nxt.double(), 1e-6)
    scale = 2.0 * max(1.0, _magnitude(x, w))
    check(h, h_ref, dtype, scale=scale)
    check(y, y_ref, dtype, scale=scale)


def test_dequant_route(gen):
    from muser.ops.triton.linear_fp8 import dequant_mm

    dtype = torch.float16
    x, w = rand(gen, 33, 160).to(dtype), _weight(gen, 48, 160, dtype)
    check(dequant_mm(x, w), _proj(x, w), dtype, scale=max(1.0, _magnitude(x, w)))


def test_scaled_mm_route(gen):
    """torch._scaled_mm's rowwise scaling as the route calls it (x [N, 1] and W [1, M] scales,
    W's codes transposed; torch has a CPU kernel too): within the activation quantization's
    2^-4 of the float64 product of x and the exact weights, and nearer still to the product
    of the quantized x."""
    from muser.ops.triton.linear_fp8 import scaled_mm

    dtype = torch.bfloat16  # _scaled_mm's rowwise scaling writes bfloat16
    x, w = rand(gen, 48, 128).to(dtype), _weight(gen, 64, 128, dtype)
    out = scaled_mm(x, w)
    assert out.dtype == dtype and out.shape == (48, 64)
    _check_quantized_x(out, x, w)
    xq = quantize_activations(x)
    on_quantized = xq.dequantize(torch.float64) @ w.dequantize(torch.float64).t()
    check(out, on_quantized, dtype, scale=max(1.0, _magnitude(x, w)))


def test_a_stored_pick_runs_without_tuning(gen):
    """A pick taken from the tuning cache (`tuning.load` -> linear_fp8.remember) is what the
    shape runs: nothing is timed, the stored config computes the output, and it is not stored
    again as if measured here."""
    from muser.ops.triton import linear_fp8
    from muser.ops.triton.gemv import GemvConfig
    from muser.ops.triton.linear import _key
    from muser.ops.triton.timing import STATS

    dtype = torch.float16
    x, w = rand(gen, 1, 64), _weight(gen, 88, 64, dtype)  # a shape no other test projects
    key, stored = _key(x.to(dtype), w, ""), GemvConfig("dot8", 16, 32, 1, 4)
    assert linear_fp8.remember({key: (stored, {"stored": 0.01})}, "cache") == 1
    assert linear_fp8.remember({key: (GemvConfig("fma", 4, 32, 1, 4), {})}, "shipped") == 0
    tuned = STATS.tuned
    out = linear(x.to(dtype), w)
    assert STATS.tuned == tuned and linear_fp8.PICKS.pick[key] == stored
    check(out, _proj(x_hat_dot8(x.to(dtype), stored), w), dtype)
    assert key not in linear_fp8.measured()
