"""Packed CPU weights and the GEMM that reads them: codes that dequantize exactly, one FMA
chain per output whatever the number of rows (so rows are bitwise independent of the call's
width), and every format against float64 within the chain's error bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from muser.ops import cpu, native, ref
from muser.ops.packed import PackedMatrix, cat_rows, dense
from muser.ops.quants import codes, dequantize
from tests.error_bounds import fma_chain_bound
from tests.test_quants import _random_raw

QT = GGMLQuantizationType
QUANTIZED = [QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


def _packed(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> PackedMatrix:
    raw = torch.from_numpy(_random_raw(qtype, rows, cols, seed))
    return PackedMatrix.from_codes(codes(raw, qtype, (rows, cols)), (rows, cols))


def _check_gemm(x: torch.Tensor, p: PackedMatrix) -> torch.Tensor:
    y = native.gemm(x, p)
    w = p.dequantize()
    err = (y.double() - x.double() @ w.double().t()).abs()
    assert (err <= fma_chain_bound(x, w)).all()
    return y


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_codes_dequantize_exactly(qtype):
    raw = torch.from_numpy(_random_raw(qtype, 40, 512, seed=3))
    p = PackedMatrix.from_codes(codes(raw, qtype, (40, 512)), (40, 512))
    assert p.data.dtype == (torch.int8 if p.bits == 8 else torch.uint8)
    assert p.group in (16, 32) and p.shape == (40, 512)
    expect = dequantize(raw, qtype, (40, 512))
    assert torch.equal(p.dequantize().view(torch.int32), expect.view(torch.int32))
    rows = torch.tensor([39, 0, 17, 17])
    assert torch.equal(p.dequantize(rows), expect[rows])


def test_float_tensors_have_no_codes():
    raw = torch.from_numpy(_random_raw(QT.F16, 4, 64, seed=1))
    assert codes(raw, QT.F16, (4, 64)) is None


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 29])
def test_gemm_over_codes_within_the_fma_chain_bound(qtype, rows):
    p = _packed(qtype, 300, 512, seed=rows)  # 300: a partial last panel
    _check_gemm(torch.randn(rows, 512, generator=torch.Generator().manual_seed(7 + rows)), p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_gemm_over_values_within_the_fma_chain_bound(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    p = PackedMatrix.from_dense(torch.randn(77, 96, generator=gen).to(dtype))
    assert p.dtype == dtype and torch.equal(dense(p), p.dequantize().to(dtype))
    _check_gemm(torch.randn(rows, 96, generator=gen), p)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_rows_are_bitwise_independent_of_the_call_width(qtype):
    """Every width (decode rows, narrow and wide tiles, their remainders) gives each row the
    same bits: one FMA chain per output, whatever the tiling."""
    p = _packed(qtype, 200, 256, seed=11)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(5))
    together = native.gemm(x, p)
    for a, b in [(0, 1), (69, 70), (3, 11), (0, 15), (0, 16), (20, 57), (1, 70)]:
        assert torch.equal(native.gemm(x[a:b], p), together[a:b]), (a, b)
    strided = torch.randn(70, 300, generator=torch.Generator().manual_seed(6))[:, :256]
    strided[:] = x
    assert torch.equal(native.gemm(strided, p), together)


def test_widened_panels_equal_the_codes():
    """A wide call widens codes to float32 once; the same values as float32 weights give the
    same bits."""
    p = _packed(QT.Q4_K, 64, 256, seed=2)
    values = PackedMatrix.from_dense(p.dequantize())
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    assert torch.equal(native.gemm(x, p), native.gemm(x, values))


def test_cat_rows_meets_groups_and_offsets():
    """Fused rows of Q5_0 (groups of 32), Q4_K (offsets) and Q6_K (groups of 16), with row
    counts that are not multiples of a panel."""
    parts = [_packed(t, 40 + 8 * i, 256, seed=i) for i, t in enumerate([QT.Q5_0, QT.Q4_K,
                                                                        QT.Q6_K])]
    fused = cat_rows(parts)
    assert fused.group == 16 and fused.mins is not None and fused.rows == 40 + 48 + 56
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    _check_gemm(x, fused)


def test_embedding_lookup_reads_codes():
    p = _packed(QT.Q8_0, 100, 64, seed=6)
    ids = torch.tensor([3, 99, 3, 0])
    assert torch.equal(ref.embed(p, ids), p.dequantize()[ids])


def test_cpu_linear_takes_packed_weights_only():
    with pytest.raises(TypeError, match="packed"):
        cpu.linear(torch.randn(2, 8), torch.randn(4, 8))


def test_loaded_model_is_codes_only(gguf_reader):
    """The 270M model's weights are the file's codes: <= 0.40 GB held, no dense matrix."""
    from muser.loading.gguf import config_from_gguf, load_weights

    cfg = config_from_gguf(gguf_reader)
    packed = load_weights(gguf_reader, cfg, torch.float32, "cpu", pack=True)
    assert isinstance(packed.embed, PackedMatrix) and packed.embed.is_codes
    assert packed.head is packed.embed
    for layer in packed.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            assert getattr(layer, name).is_codes
    print(f"weights held: {packed.nbytes() / 1e9:.3f} GB")
    assert packed.nbytes() <= 0.40e9


def test_real_model_head_and_layer(gguf_reader):
    """The embedded model's tied head (Q8_0) and a Q4_K projection, against float64."""
    tensors = {t.name: t for t in gguf_reader.tensors}
    for name in ["token_embd.weight", "blk.0.attn_output.weight"]:
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))
        p = PackedMatrix.from_codes(codes(raw, t.tensor_type, shape), shape)
        assert torch.equal(p.dequantize(), dequantize(raw, t.tensor_type, shape))
        _check_gemm(torch.randn(2, shape[1], generator=torch.Generator().manual_seed(0)), p)


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    from muser.errors import MuserError

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MUSER_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    try:
        with pytest.raises(MuserError, match="no C compiler"):
            cpu.prepare_weights(None)
    finally:
        native.library.cache_clear()


def test_reference_ops_keep_dense_weights(monkeypatch):
    """MUSER_OPS=ref runs the torch spec, which reads dense weights: no codes are kept."""
    from muser.config import EngineConfig
    from muser.llm import _keeps_codes

    assert _keeps_codes(EngineConfig.for_device(device="cpu", dtype="float32"))
    assert not _keeps_codes(EngineConfig.for_device(device="cpu", dtype="float16"))
    monkeypatch.setenv("MUSER_OPS", "ref")
    assert not _keeps_codes(EngineConfig.for_device(device="cpu", dtype="float32"))


@pytest.mark.parametrize("qtype, bits", [(QT.Q4_K, 4), (QT.Q5_0, 5), (QT.Q4_0, 5)],
                         ids=lambda t: getattr(t, "name", t))
def test_narrow_codes_give_the_bits_of_int8_codes(qtype, bits):
    """Codes held at 4 or 5 bits unpack in registers to the integers int8 codes hold: every
    width (decode rows, narrow and wide tiles, a partial last panel) gives the same bits as
    the same codes at one byte each, at a fraction of the bytes."""
    p = _packed(qtype, 300, 512, seed=bits)
    assert p.bits == bits and p.data.dtype == torch.uint8 and p.shape == (300, 512)
    wide = PackedMatrix(p.codes(), p.scales, p.mins, p.group, p.rows)
    assert wide.bits == 8 and wide.data.dtype == torch.int8
    assert p.data.nbytes * 8 == wide.data.nbytes * bits
    assert torch.equal(p.dequantize(), wide.dequantize())
    gen = torch.Generator().manual_seed(11)
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 37):
        x = torch.randn(rows, 512, generator=gen)
        assert torch.equal(native.gemm(x, p), native.gemm(x, wide)), rows
