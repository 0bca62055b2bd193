"""Packed CPU decode weights: GGUF codes that dequantize exactly, and the C kernel that reads
them (against float64, row by row, through the ops layer and the whole model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from muser.loading.quants import codes, dequantize
from muser.ops import cpu, native, ref
from muser.ops.packed import PackedMatrix, cat_rows
from tests.test_quants import _random_raw

QT = GGMLQuantizationType
QUANTIZED = [QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


def _packed(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> PackedMatrix:
    raw = torch.from_numpy(_random_raw(qtype, rows, cols, seed))
    w = dequantize(raw, qtype, (rows, cols))
    return PackedMatrix.from_codes(codes(raw, qtype, (rows, cols)), (rows, cols), w)


def _realistic(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> PackedMatrix:
    """Random codes with scales of one magnitude (the test blocks span 10^-7..10^2, which
    makes a float32 dot product's relative error meaningless)."""
    p = _packed(qtype, rows, cols, seed)
    gen = torch.Generator().manual_seed(seed)
    p.scales = torch.rand(p.scales.shape, generator=gen) * 0.02 + 0.01
    if p.mins is not None:
        p.mins = torch.rand(p.mins.shape, generator=gen) * 0.1
    p.dense = p.dequantize()
    return p


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_codes_dequantize_exactly(qtype):
    raw = torch.from_numpy(_random_raw(qtype, 8, 512, seed=3))
    p = PackedMatrix.from_codes(codes(raw, qtype, (8, 512)), (8, 512),
                                dequantize(raw, qtype, (8, 512)))
    assert p.codes.dtype == torch.int8 and p.group in (16, 32)
    assert torch.equal(p.dequantize().view(torch.int32), p.dense.view(torch.int32))


def test_float_tensors_have_no_codes():
    raw = torch.from_numpy(_random_raw(QT.F16, 4, 64, seed=1))
    assert codes(raw, QT.F16, (4, 64)) is None


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_qgemv_matches_float64(qtype, rows):
    p = _realistic(qtype, 300, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(7 + rows))
    y = native.qgemv(x, p)
    expect = x.double() @ p.dense.double().t()
    err = (y.double() - expect).abs().max() / expect.abs().max()
    assert err < 1e-6, f"relative error {err:.2e}"


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_qgemv_rows_are_independent(qtype):
    """A row's bits do not depend on how many rows share the call (batch independence)."""
    p = _realistic(qtype, 1000, 256, seed=11)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    together = native.qgemv(x, p)
    for r in range(8):
        alone = native.qgemv(x[r : r + 1], p)
        assert torch.equal(alone[0], together[r])


def test_cat_rows_meets_groups_and_offsets():
    """Fused rows of Q5_0 (groups of 32), Q4_K (offsets) and Q6_K (groups of 16)."""
    parts = [_realistic(t, 48, 256, seed=i) for i, t in enumerate([QT.Q5_0, QT.Q4_K, QT.Q6_K])]
    fused = cat_rows(parts)
    assert fused.group == 16 and fused.mins is not None
    assert torch.equal(fused.dequantize(), torch.cat([p.dense for p in parts]))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    expect = x.double() @ fused.dense.double().t()
    assert (native.qgemv(x, fused).double() - expect).abs().max() < 1e-5 * expect.abs().max()


def test_cpu_linear_reads_codes_for_decode_rows_only():
    p = _realistic(QT.Q8_0, 64, 128, seed=4)
    gen = torch.Generator().manual_seed(9)
    decode, chunk = torch.randn(native.MAX_ROWS, 128, generator=gen), torch.randn(9, 128)
    assert torch.equal(cpu.linear(decode, p), native.qgemv(decode, p))
    assert torch.equal(cpu.linear(chunk, p), ref.linear(chunk, p.dense))
    assert torch.equal(ref.linear(decode, p), ref.linear(decode, p.dense))


def test_packed_embedding_without_dense_twin():
    """The tied embedding keeps only codes: lookups dequantize rows exactly, and products of
    any width read the codes."""
    p = _realistic(QT.Q8_0, 100, 64, seed=6)
    full, p.dense = p.dense, None
    ids = torch.tensor([3, 99, 3, 0])
    assert torch.equal(ref.embed(p, ids), full[ids])
    x = torch.randn(19, 64, generator=torch.Generator().manual_seed(1))
    y = cpu.linear(x, p)
    assert torch.equal(y[8:16], native.qgemv(x[8:16], p))
    assert (y.double() - x.double() @ full.double().t()).abs().max() < 1e-5


def test_loaded_model_keeps_codes_not_a_dense_head(gguf_reader):
    """Packed: the 262,144 x 640 embedding is held as int8 codes only (~0.19 GB, not 0.67)."""
    from muser.loading.gguf import config_from_gguf, load_weights

    cfg = config_from_gguf(gguf_reader)
    packed = load_weights(gguf_reader, cfg, torch.float32, "cpu", pack=True)
    assert isinstance(packed.embed, PackedMatrix) and packed.embed.dense is None
    assert packed.head is packed.embed
    assert isinstance(packed.layers[0].qkv, PackedMatrix)
    assert packed.layers[0].qkv.dense is not None  # prefill GEMMs
    plain = load_weights(gguf_reader, cfg, torch.float32, "cpu")
    print(f"weights held: packed {packed.nbytes() / 1e9:.2f} GB, dense {plain.nbytes() / 1e9:.2f}")
    assert packed.nbytes() < 0.8 * plain.nbytes()


def test_real_model_head_and_layer(gguf_reader):
    """The embedded model's tied head (Q8_0) and a Q4_K projection, against float64."""
    tensors = {t.name: t for t in gguf_reader.tensors}
    for name in ["token_embd.weight", "blk.0.attn_output.weight"]:
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))
        p = PackedMatrix.from_codes(codes(raw, t.tensor_type, shape), shape,
                                    dequantize(raw, t.tensor_type, shape))
        x = torch.randn(1, shape[1], generator=torch.Generator().manual_seed(0))
        expect = x.double() @ p.dense.double().t()
        err = (native.qgemv(x, p).double() - expect).abs().max() / expect.abs().max()
        assert err < 1e-6, f"{name}: relative error {err:.2e}"


def test_missing_compiler_is_a_clear_error_or_a_warning(monkeypatch, tmp_path):
    from muser.config import EngineConfig
    from muser.errors import MuserError
    from muser.llm import _packed

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MUSER_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    try:
        with pytest.raises(MuserError, match="no C compiler"):
            _packed(EngineConfig(device="cpu", dtype="float32", decode_weights="packed"))
        with pytest.warns(UserWarning, match="dense float32"):
            assert not _packed(EngineConfig(device="cpu", dtype="float32"))
        with pytest.raises(MuserError, match="needs --device cpu and --dtype float32"):
            _packed(EngineConfig(device="cpu", dtype="float16", decode_weights="packed"))
        assert not _packed(EngineConfig(device="cpu", dtype="float16"))
    finally:
        native.library.cache_clear()


def test_packed_and_dense_decode_agree(gguf_path):
    """The whole model: greedy tokens equal, logits within float32 rounding."""
    from muser import LLM
    from muser.core import SamplingParams

    outs = {}
    for mode in ("packed", "dense"):
        llm = LLM(gguf_path, progress=False, max_num_seqs=1, max_model_len=256,
                  decode_weights=mode)
        outs[mode] = llm.generate("The capital of France is", SamplingParams(max_tokens=12))
    assert outs["packed"].token_ids == outs["dense"].token_ids


def test_reference_ops_keep_dense_weights(monkeypatch):
    """MUSER_OPS=ref runs the torch spec, which reads dense weights: nothing is packed."""
    from muser.config import EngineConfig
    from muser.errors import MuserError
    from muser.llm import _packed

    monkeypatch.setenv("MUSER_OPS", "ref")
    assert not _packed(EngineConfig(device="cpu", dtype="float32"))
    with pytest.raises(MuserError, match="MUSER_OPS=ref"):
        _packed(EngineConfig(device="cpu", dtype="float32", decode_weights="packed"))
