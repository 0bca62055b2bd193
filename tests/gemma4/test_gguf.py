"""Gemma 4 from GGUF files of llama.cpp's `gemma4` architecture (tests/gemma4/gguf_file.py writes
them as its convert_hf_to_gguf.py does): every variant of tests/gemma4/checkpoints.py gives
the same ModelConfig and bitwise the same logits from its F32 GGUF file as from its
safetensors checkpoint; a Q8_0 file's block codes give bitwise the logits of a checkpoint
holding the values they stand for; the file's `gemma4` tokenizer encodes as tokenizer.json."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from muser.loading import LoadedModel, load_model
from muser.ops.packed import PackedMatrix
from tests.gemma4.checkpoints import VARIANTS, W, write_checkpoint
from tests.gemma4.gguf_file import F32, Q8_0, dequantized, write_gguf
from tests.gemma4.test_parity import prompt, runner_of

LENGTH = 4 * W + 3


def _logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    runner = runner_of(model)
    return runner.forward([runner.allocate()], [ids], logit_rows=list(range(len(ids))))


def _load(path: Path) -> LoadedModel:
    return load_model(path, torch.float32, "cpu", progress=False)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_f32_gguf_is_bitwise_the_safetensors_checkpoint(tmp_path: Path, variant: str) -> None:
    checkpoint = write_checkpoint(variant, tmp_path / "hf")
    hf, gg = _load(checkpoint), _load(write_gguf(checkpoint, tmp_path / "model.gguf", F32))
    # NOTE: GGUF stores the epsilon as float32, which the kernels take it as anyway
    eps = hf.config.rms_norm_eps
    assert gg.config.rms_norm_eps == torch.tensor(eps, dtype=torch.float32).item()
    assert dataclasses.replace(gg.config, rms_norm_eps=eps) == hf.config
    ids = prompt(LENGTH, 3)
    assert torch.equal(_logits(gg, ids), _logits(hf, ids))


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_q8_0_gguf_is_bitwise_its_values(tmp_path: Path, variant: str) -> None:
    """Q8_0 matrices stay block codes on the CPU (muser.ops.packed); their logits are those
    of a safetensors checkpoint holding gguf's dequantized values of the same matrices."""
    checkpoint = write_checkpoint(variant, tmp_path / "hf")
    path = write_gguf(checkpoint, tmp_path / "model.gguf", Q8_0)
    gg = load_model(path, torch.float32, "cpu", progress=False, pack=True)  # as LLM on the CPU
    assert all(isinstance(layer.qkv, PackedMatrix) and layer.qkv.scales is not None
               for layer in gg.weights.layers)  # codes, not values
    if variant == "moe":
        assert all(m.scales is not None for m in gg.weights.layers[0].moe.gate_up)
    tensors = load_file(checkpoint / "model.safetensors")
    mirror = {name: dequantized(t, Q8_0) if _is_q8_0(name, t) else t
              for name, t in tensors.items()}
    save_file(mirror, checkpoint / "model.safetensors")
    ids = prompt(LENGTH, 4)
    assert torch.equal(_logits(gg, ids), _logits(_load(checkpoint), ids))


def _is_q8_0(name: str, t: torch.Tensor) -> bool:
    """Whether write_gguf stored this checkpoint tensor as Q8_0."""
    gains = ("norm", "router.scale", "per_expert_scale", "layer_scalar")
    return t.dim() >= 2 and t.shape[-1] % 32 == 0 and not any(g in name for g in gains)


def _gemma_tokenizer(directory: Path) -> None:
    """A tokenizer.json shaped as Gemma's: spaces normalized to '▁', BPE over the whole text
    with byte fallback, special tokens split out."""
    from tokenizers import AddedToken, normalizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab = {t: n for n, t in enumerate(pieces + ["a", "b", "ab", "▁", "▁a", "▁ab", "▁▁"])}
    merges = [("a", "b"), ("▁", "ab"), ("▁", "a"), ("▁", "▁")]
    hf = HFTokenizer(BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.add_tokens([AddedToken(t, special=True) for t in list(vocab)[:4]])
    hf.save(str(directory / "tokenizer.json"))


def test_gemma4_tokenizer_encodes_as_tokenizer_json(tmp_path: Path) -> None:
    checkpoint = write_checkpoint("dense", tmp_path / "hf")
    _gemma_tokenizer(checkpoint)
    hf, gg = _load(checkpoint), _load(write_gguf(checkpoint, tmp_path / "model.gguf", F32))
    for text in ("abba\n", "ab ab  a", "<bos>b\tab", "é ab   ab"):
        assert gg.tokenizer.encode(text) == hf.tokenizer.encode(text), text
    assert gg.tokenizer.encode("ab ab") == [2, 262, 265]  # 'ab', '▁ab'
    assert gg.tokenizer.decode(gg.tokenizer.encode("ab ba é"), skip_special=True) == "ab ba é"
