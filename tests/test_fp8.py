"""FP8 weights (muser/ops/fp8.py): per-row e4m3 quantization against a float64 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from muser.errors import MuserError
from muser.ops.fp8 import FP8, FP8_MAX, Fp8Matrix, cat_rows, quantize_fp8, require_fp8_device


def _bound(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The most |w - dequantized| may be, per element, in float64.

    q = RN_e4m3(RN_f32(w / s)), s = RN_f32(amax / 448) per row. e4m3 has 3 stored mantissa
    bits, so between 2^-6 and 448 its spacing near v is at most 2^-3 |v| and rounding to
    nearest moves v by at most half of it: 2^-4 |v|. Below 2^-6 the values are subnormal with
    fixed spacing 2^-9, so rounding moves v by at most 2^-10. The float32 quotient adds
    2^-24 |w / s|, and a row's max may land up to 2^-23 above 448 (s was rounded), which the
    clamp takes back: within 2^-22 |w / s| in all. Multiplying by s (exactly, in float64):
    |w - q s| <= (2^-4 + 2^-22) |w| + 2^-10 s."""
    return (2.0**-4 + 2.0**-22) * w.abs() + 2.0**-10 * scales[:, None]


def test_quantize_error_bound():
    gen = torch.Generator().manual_seed(0)
    # rows of very different ranges, some values deep in the subnormals of their row
    w = torch.randn(64, 300, generator=gen, dtype=torch.float64)
    w = w * torch.logspace(-30, 30, 64, base=2, dtype=torch.float64)[:, None]
    w[:, :10] *= 2.0**-12
    q = quantize_fp8(w.float())
    assert q.data.dtype == FP8 and q.scales.dtype == torch.float32 and q.shape == (64, 300)
    deq = q.data.double() * q.scales.double()[:, None]
    w32 = w.float().double()
    assert ((w32 - deq).abs() <= _bound(w32, q.scales.double())).all()
    # the scale puts each row's largest magnitude on 448 (up to the scale's float32 rounding)
    top = (w32.abs().amax(1) / q.scales.double())
    assert ((top - FP8_MAX).abs() <= FP8_MAX * 2.0**-22).all()
    assert torch.equal(q.dequantize(), (q.data.float() * q.scales[:, None]))


def test_quantize_is_round_to_nearest():
    """Each code is an e4m3 value nearest w / s: no other code is closer (ties go either way
    only by the even rule, and no tie is closer than the chosen code)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = codes[~codes.isnan()].double().unique()
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 500, generator=gen)
    q = quantize_fp8(w)
    v = (w / q.scales[:, None]).clamp(-FP8_MAX, FP8_MAX).double()
    dist = (v[..., None] - grid).abs().amin(-1)
    assert torch.equal((v - q.data.double()).abs(), dist)


def test_zero_rows_and_dtypes():
    w = torch.zeros(3, 16, dtype=torch.bfloat16)
    w[1] = torch.linspace(-1, 1, 16)
    q = quantize_fp8(w)
    assert q.dtype == torch.bfloat16
    assert torch.equal(q.data[0].float(), torch.zeros(16)) and q.scales[0] > 0
    assert torch.equal(q.dequantize()[0], torch.zeros(16))
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert q.nbytes() == 3 * 16 + 3 * 4


def test_cat_rows_keeps_each_part():
    gen = torch.Generator().manual_seed(2)
    a, b = (quantize_fp8(torch.randn(m, 32, generator=gen) * s) for m, s in ((4, 1e-3), (6, 9.0)))
    fused = cat_rows([a, b])
    assert fused.shape == (10, 32)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(TypeError):
        cat_rows([a, Fp8Matrix(b.data, b.scales, torch.bfloat16)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusal")
def test_cpu_refused():
    with pytest.raises(MuserError, match="CPU backend has no FP8 kernels"):
        require_fp8_device("cpu")


def test_fp8_head_is_the_whole_head_quantized(monkeypatch):
    """with_fp8_head: the head quantized in slices equals it quantized whole (rows are
    independent); a tied head becomes the embedding, whose lookup then reads the rows'
    dequantized codes; an untied head leaves the embedding as it was."""
    from muser.config import ModelConfig, gemma3_layer_kinds
    from muser.graph import weights as weights_module
    from muser.graph.weights import random_weights, with_fp8_head
    from muser.ops import ref

    cfg = ModelConfig(architecture="gemma3", vocab_size=100, hidden_size=32,
                      intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, layer_kinds=gemma3_layer_kinds(2, pattern=2),
                      sliding_window=8, rope_theta=1e6, rope_local_theta=1e4,
                      query_pre_attn_scalar=16.0)
    tied = random_weights(cfg, torch.bfloat16, "cpu", seed=1, fp8=True)
    monkeypatch.setattr(weights_module, "HEAD_SLICE_ROWS", 7)  # 100 rows: 15 slices
    got = with_fp8_head(tied)
    whole = quantize_fp8(tied.embed)
    assert got.lm_head is None and got.head is got.embed and got.embed.dtype == torch.bfloat16
    assert torch.equal(got.embed.data.view(torch.uint8), whole.data.view(torch.uint8))
    assert torch.equal(got.embed.scales, whole.scales)
    ids = torch.tensor([0, 99, 5, 5])
    assert torch.equal(ref.embed(got.embed, ids), whole.dequantize()[ids])
    assert with_fp8_head(got) is got  # already FP8
    untied = dataclasses.replace(tied, lm_head=tied.embed.clone())
    got = with_fp8_head(untied)
    assert got.embed is untied.embed and isinstance(got.lm_head, Fp8Matrix)
    assert torch.equal(got.lm_head.scales, whole.scales)


def test_fp8_head_only_with_fp8():
    from muser.cli import build_parser, engine_kwargs
    from muser.config import EngineConfig

    assert EngineConfig.for_device("cpu", quantization="fp8").fp8_head is True
    assert EngineConfig.for_device("cpu", quantization="fp8", fp8_head=False).fp8_head is False
    assert EngineConfig.for_device("cpu").fp8_head is False
    assert dataclasses.replace(EngineConfig.for_device("cpu"), max_model_len=64).fp8_head is False
    assert dataclasses.replace(EngineConfig.for_device("cpu", quantization="fp8"),
                               max_model_len=64).fp8_head
    with pytest.raises(ValueError, match="fp8_head applies to quantization 'fp8' only"):
        EngineConfig.for_device("cpu", fp8_head=True)
    args = build_parser().parse_args(["generate", "hi", "--quantization", "fp8",
                                      "--no-fp8-head"])
    assert engine_kwargs(args)["fp8_head"] is False
    with pytest.raises(MuserError, match="apply with --quantization fp8 only"):
        engine_kwargs(build_parser().parse_args(["generate", "hi", "--fp8-head"]))


def test_fp8_weights_fingerprint_apart():
    """A worker or slot file whose KV came from FP8 weights (with or without the FP8 head) does
    not pass for one of the weights as stored: the form enters the fingerprint; weights as
    stored fingerprint as they did before the form existed."""
    import hashlib

    from muser.loading.fingerprint import fingerprint
    from muser.presets import preset

    cfg, path = preset("gemma3-1b"), "dummy:gemma3-1b@cuda"
    prints = {form: fingerprint(cfg, path, form) for form in ("", "fp8", "fp8+head")}
    assert len(set(prints.values())) == 3
    digest = hashlib.sha256(repr(cfg).encode())
    digest.update(path.encode())
    assert prints[""] == digest.hexdigest()[:16]
