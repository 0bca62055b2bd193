"""FP8 weights at load: pre-quantized Hugging Face checkpoints (compressed-tensors and
fbgemm_fp8 layouts, written here as tiny safetensors with float8_e4m3fn weights and their
scales) and --quantization fp8 of unquantized ones, read on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from muser.config import ModelConfig, gemma3_layer_kinds
from muser.errors import ModelLoadError
from muser.loading import load_model
from muser.loading.fp8_checkpoint import fp8_layout
from muser.loading.hf import Shards, _layer_names, _shapes, load_weights_hf
from muser.loading.names import HF_LAYER_NAMES
from muser.ops.fp8 import FP8, Fp8Matrix, quantize_fp8
from tests.hf_checkpoint import hf_config, write_safetensors

CFG = ModelConfig(architecture="gemma3", vocab_size=64, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                  layer_kinds=gemma3_layer_kinds(2), sliding_window=8, rope_theta=1e6,
                  rope_local_theta=1e4)
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
               "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
           "ignore": ["lm_head"]}
BLOCK = {**CHANNEL, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
    "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 16]}}}}
FBGEMM = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
          "modules_to_not_convert": ["lm_head"]}


def _scale(m: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    shape = {"channel": (m, 1), "tensor": (1,), "block": (-(-m // 16), -(-k // 16))}[kind]
    return torch.rand(shape, generator=gen) * 0.01 + 1e-3


def _checkpoint(tmp_path: Path, quant: dict | None, kind: str = "channel",
                scale_dtype=torch.float32, drop: str | None = None) -> tuple[Path, dict]:
    """A tiny checkpoint: projections as random e4m3 codes with `kind` scales (quant None:
    bfloat16 values), the rest bfloat16 -> (its directory, every tensor written)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(CFG.num_layers):
        shapes = _shapes(CFG, i)
        for name in (n for names in _layer_names(CFG, i).values() for n in names):
            shape, full = shapes[name], f"model.layers.{i}.{name}"
            if len(shape) == 1 or quant is None:
                tensors[full] = torch.randn(shape, generator=gen).to(torch.bfloat16)
            else:
                tensors[full] = (torch.randn(shape, generator=gen) * 50).to(FP8)
                tensors[full + "_scale"] = _scale(*shape, kind, gen).to(scale_dtype)
    tensors["model.embed_tokens.weight"] = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.randn(32, generator=gen).to(torch.bfloat16)
    tensors.pop(drop, None)
    config = hf_config(CFG) | ({"quantization_config": quant} if quant else {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_safetensors(tmp_path, tensors, 1)
    return tmp_path, tensors


def _load(directory: Path, fp8: bool, dtype=torch.float32):
    layout = fp8_layout(json.loads((directory / "config.json").read_text()))
    return load_weights_hf(Shards(directory), CFG, dtype, "cpu", fp8=fp8, layout=layout)


def _parts(tensors: dict, i: int, field: str) -> list[str]:
    names = HF_LAYER_NAMES[field]
    return [f"model.layers.{i}.{n}" for n in ([names] if isinstance(names, str) else names)]


def _row_scales(tensors: dict, name: str) -> torch.Tensor:
    s = tensors[name + "_scale"].float()
    return s.reshape(-1).expand(tensors[name].shape[0]) if s.numel() == 1 else s.reshape(-1)


@pytest.mark.parametrize("quant,kind,scale_dtype", [
    (CHANNEL, "channel", torch.bfloat16), (CHANNEL, "tensor", torch.float32),
    (FBGEMM, "channel", torch.float32)])
def test_prequantized_loads_as_stored(tmp_path, quant, kind, scale_dtype):
    """Codes and scales as stored, fused rows in order; without --quantization fp8 the same
    checkpoint loads dequantized (W = weight * weight_scale)."""
    directory, tensors = _checkpoint(tmp_path, quant, kind, scale_dtype)
    fp8, dense = _load(directory, True), _load(directory, False)
    for i in range(CFG.num_layers):
        for field in PROJECTIONS:
            w, names = getattr(fp8.layers[i], field), _parts(tensors, i, field)
            assert isinstance(w, Fp8Matrix) and w.dtype == torch.float32
            assert torch.equal(w.data.view(torch.uint8),
                               torch.cat([tensors[n] for n in names]).view(torch.uint8))
            assert torch.equal(w.scales, torch.cat([_row_scales(tensors, n) for n in names]))
            want = torch.cat([tensors[n].float() * _row_scales(tensors, n)[:, None]
                              for n in names])
            assert torch.equal(getattr(dense.layers[i], field), want)
        assert torch.equal(fp8.layers[i].attn_norm, dense.layers[i].attn_norm)
    assert torch.equal(fp8.embed, tensors["model.embed_tokens.weight"].float())


def test_block_scales_requantized_per_row(tmp_path):
    """Per-block scales: dequantized exactly without --quantization fp8; with it, the same
    values requantized to per-row scales (quantize_fp8 of them)."""
    directory, tensors = _checkpoint(tmp_path, BLOCK, "block")
    fp8, dense = _load(directory, True), _load(directory, False)
    name = "model.layers.1.mlp.down_proj.weight"  # [32, 48]: blocks 2 x 3
    s = tensors[name + "_scale"].repeat_interleave(16, 0).repeat_interleave(16, 1)
    want = tensors[name].float() * s
    assert torch.equal(dense.layers[1].down, want)
    q = quantize_fp8(want)
    assert torch.equal(fp8.layers[1].down.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(fp8.layers[1].down.scales, q.scales)


def test_quantize_unquantized_checkpoint(tmp_path):
    directory, tensors = _checkpoint(tmp_path, None)
    weights = _load(directory, True, torch.bfloat16)
    names = _parts(tensors, 0, "gate_up")
    q = weights.layers[0].gate_up
    assert isinstance(q, Fp8Matrix) and q.dtype == torch.bfloat16 and q.data.dtype == FP8
    parts = [quantize_fp8(tensors[n]) for n in names]
    assert torch.equal(q.data.view(torch.uint8), torch.cat([p.data for p in parts]).view(
        torch.uint8))
    assert weights.embed.dtype == torch.bfloat16 and weights.dtype == torch.bfloat16
    layers = weights.layers
    assert weights.nbytes() == weights.embed.nbytes + weights.final_norm.nbytes + sum(
        part.nbytes() if f in PROJECTIONS else part.nbytes
        for layer in layers for f, part in layer.parts().items())


def test_missing_scale(tmp_path):
    directory, _ = _checkpoint(tmp_path, CHANNEL,
                               drop="model.layers.1.self_attn.k_proj.weight_scale")
    with pytest.raises(ModelLoadError, match=r"lacks tensor 'model\.layers\.1\.self_attn\."
                       r"k_proj\.weight_scale' \(the scale of FP8 weight"):
        _load(directory, True)


def test_wrong_scale_shape(tmp_path):
    """Block-shaped scales in a checkpoint that declares per-channel ones."""
    directory, _ = _checkpoint(tmp_path, CHANNEL, "block")
    with pytest.raises(ModelLoadError, match=r"weight_scale' has shape \[2, 2\]; the FP8 "
                       r"weight \[32, 32\] takes \[32, 1\] \(per row\) or \[1\]"):
        _load(directory, True)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({**CHANNEL, "format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
    ({**CHANNEL, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "quantizes weights to 4-bit int; muser loads 8-bit float"),
])
def test_unsupported_quantization_config(quant, message):
    with pytest.raises(ModelLoadError, match=message):
        fp8_layout({"quantization_config": quant})


def test_fp8_tensor_in_unquantized_checkpoint(tmp_path):
    directory, _ = _checkpoint(tmp_path, CHANNEL)
    with pytest.raises(ModelLoadError, match="is torch.float8_e4m3fn; muser reads bfloat16"):
        load_weights_hf(Shards(directory), CFG, torch.float32, "cpu")


def test_gguf_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="--quantization fp8 loads Hugging Face checkpoints"):
        load_model(tmp_path / "model.gguf", torch.bfloat16, "cpu", fp8=True)
