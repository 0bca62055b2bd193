"""Hugging Face checkpoints: the embedded 270M written out in HF layout (tests/hf_checkpoint.py)
loads back to logits bitwise equal to the GGUF path and to the same token ids; config.json
variants map onto ModelConfig; each kind of bad checkpoint ends in one clear error."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file

from muser.config import EngineConfig, ModelConfig
from muser.errors import ModelLoadError
from muser.loading import load_model
from muser.loading.gguf import config_from_gguf
from muser.loading.hf import config_from_hf
from muser.loading.hf_tokenizer import tokenizer_from_hf
from muser.presets import preset
from muser.runner import Runner
from muser.tokenizer import Tokenizer, gemma_chat_format
from tests.hf_checkpoint import export_hf, hf_config
from tests.test_tokenizer import ENTRIES

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4 + "<start_of_turn>user\nHi"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, gguf_reader: gguf.GGUFReader) -> Path:
    """The embedded GGUF as a two-shard float32 HF checkpoint."""
    return export_hf(gguf_reader, tmp_path_factory.mktemp("hf") / "gemma-3-270m")


def _logits(path: Path, pack: bool) -> tuple[list[int], torch.Tensor]:
    """Ids of PROMPT and float32 CPU logits at every prompt row, then of two decode steps."""
    model = load_model(path, torch.float32, "cpu", progress=False, pack=pack)
    engine = EngineConfig.for_device(device="cpu", dtype="float32", kv_dtype="float32",
                                     max_num_seqs=1, max_model_len=256)
    runner = Runner(model.config, engine, model.weights)
    ids = model.tokenizer.encode(PROMPT)
    seq = runner.allocate()
    rows = [runner.forward([seq], [ids], logit_rows=list(range(len(ids))))]
    rows += [runner.forward([seq], [[t]]) for t in (9259, 1902)]
    return ids, torch.cat(rows)


def test_logits_bitwise_equal_gguf(hf_dir: Path, gguf_path: Path, gguf_reader) -> None:
    model_config = config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    assert model_config == config_from_gguf(gguf_reader)
    gguf_ids, gguf_logits = _logits(gguf_path, pack=True)  # the CPU default: the file's codes
    hf_ids, hf_logits = _logits(hf_dir / "config.json", pack=False)  # float32 values
    assert hf_ids == gguf_ids
    assert torch.equal(hf_logits, gguf_logits)


@pytest.fixture(scope="module")
def hf_tok(hf_dir: Path) -> Tokenizer:
    return tokenizer_from_hf(hf_dir)


def test_tokenizer_ids_equal_gguf(hf_tok: Tokenizer, gguf_reader: gguf.GGUFReader) -> None:
    tok = Tokenizer.from_gguf(gguf_reader)
    for entry in ENTRIES:
        assert hf_tok.encode(entry["text"]) == entry["ids"], entry["text"]
        assert hf_tok.decode(entry["ids"]) == entry["detokenized"]
        plain = hf_tok.encode(entry["text"], parse_special=False)
        assert plain == tok.encode(entry["text"], parse_special=False), entry["text"]
    assert (hf_tok.vocab_size, hf_tok.bos_id, hf_tok.eos_id) == (262144, 2, 1)
    assert hf_tok.eot_ids == tok.eot_ids
    assert [hf_tok.token_to_piece(i) for i in range(hf_tok.vocab_size)] == [
        tok.token_to_piece(i) for i in range(tok.vocab_size)]


def test_chat_template_from_tokenizer_config(hf_tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    assert hf_tok.apply_chat_template(messages) == gemma_chat_format(messages, True)


# Official config.json layouts (the 4B's is the multimodal one: text_config lists only what
# differs from transformers' defaults), and the newer rope_parameters / layer_types form.
_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
       "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                       "model_type": "gemma3_text", "sliding_window": 1024,
                       "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}


def test_multimodal_config_maps_onto_the_preset() -> None:
    assert config_from_hf(_4B) == dataclasses.replace(preset("gemma3-4b"), vocab_size=262208)


def test_rope_parameters_and_layer_types_form() -> None:
    text = dict(_4B["text_config"], rope_scaling=None, layer_types=[
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert config_from_hf(dict(_4B, text_config=text)) == config_from_hf(_4B)


TINY = ModelConfig(
    architecture="gemma3", vocab_size=300, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=16, layer_kinds=("sliding", "global"),
    sliding_window=8, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=16,
    max_position_embeddings=128, tie_word_embeddings=False,
)


def _tiny_tensors(prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    h, i, q, kv = TINY.hidden_size, TINY.intermediate_size, TINY.q_size, TINY.kv_size
    shapes = {"embed_tokens.weight": (TINY.vocab_size, h), "norm.weight": (h,)}
    for n in range(TINY.num_layers):
        shapes |= {f"layers.{n}.{k}": s for k, s in {
            "input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.q_norm.weight": (16,), "self_attn.k_norm.weight": (16,),
            "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
            "pre_feedforward_layernorm.weight": (h,), "mlp.gate_proj.weight": (i, h),
            "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
            "post_feedforward_layernorm.weight": (h,)}.items()}
    out = {prefix + k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}
    out["lm_head.weight"] = torch.randn(TINY.vocab_size, h, generator=gen).to(dtype)
    return out


def _tiny_tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab = {t: n for n, t in enumerate(pieces + ["a", "b", "ab"])}
    hf = HFTokenizer(BPE(vocab, [("a", "b")], unk_token="<unk>", byte_fallback=True))
    hf.add_tokens([AddedToken(t, special=True) for t in list(vocab)[:4]])
    hf.save(str(directory / "tokenizer.json"))


def _tiny_checkpoint(directory: Path, multimodal: bool = False) -> Path:
    directory.mkdir(parents=True)
    config = hf_config(TINY)
    prefix = "model."
    if multimodal:
        config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                  "text_config": config}
        prefix = "language_model.model."
    (directory / "config.json").write_text(json.dumps(config))
    dtype = torch.bfloat16 if multimodal else torch.float32
    save_file(_tiny_tensors(prefix, dtype), directory / "model.safetensors")
    _tiny_tokenizer(directory)
    return directory


def test_tiny_checkpoints_of_both_layouts(tmp_path: Path) -> None:
    """The text model's prefix comes from the tensor names; bfloat16 tensors widen exactly."""
    text = load_model(_tiny_checkpoint(tmp_path / "text"), torch.float32, "cpu", False)
    multi = load_model(_tiny_checkpoint(tmp_path / "mm", True), torch.float32, "cpu", False)
    assert text.config == multi.config == TINY
    assert text.tokenizer.encode("abba\n") == [2, 262, 261, 260, 10 + 4]  # '\n': a byte
    assert text.tokenizer.vocab_size == TINY.vocab_size  # 263 tokens, then unused ids
    assert text.tokenizer.decode([262, 299]) == "ab"
    raw = _tiny_tensors("model.", torch.float32)
    assert torch.equal(text.weights.lm_head, raw["lm_head.weight"])
    assert torch.equal(text.weights.layers[1].attn_norm,
                       1.0 + raw["model.layers.1.input_layernorm.weight"])
    bf16 = {k: v.to(torch.bfloat16).float() for k, v in raw.items()}
    assert torch.equal(multi.weights.layers[0].qkv, torch.cat(
        [bf16[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))


def _break(directory: Path, how: str) -> None:
    """Damage a tiny checkpoint one way."""
    shard, config = directory / "model.safetensors", directory / "config.json"
    if how == "no config":
        config.unlink()
    elif how == "corrupt config":
        config.write_text("{ not json")
    elif how == "llama":
        config.write_text(json.dumps(dict(hf_config(TINY), architectures=["LlamaForCausalLM"])))
    elif how == "shape":
        config.write_text(json.dumps(dict(hf_config(TINY), intermediate_size=64)))
    elif how == "no tokenizer":
        (directory / "tokenizer.json").unlink()
    elif how == "corrupt tokenizer":
        (directory / "tokenizer.json").write_text('{"model": 3}')
    elif how == "no weights":
        shard.unlink()
    elif how == "missing shard":
        shard.unlink()
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}))
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "missing tensor":
        tensors = _tiny_tensors("model.", torch.float32)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, shard)
    elif how == "int8":
        tensors = _tiny_tensors("model.", torch.float32)
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
        save_file(tensors, shard)


@pytest.mark.parametrize(("how", "message"), [
    ("no config", "lacks config.json"),
    ("corrupt config", "config.json: not valid JSON"),
    ("llama", "unsupported architecture 'LlamaForCausalLM'"),
    ("shape", re.escape("'model.layers.0.mlp.gate_proj.weight' has shape (48, 32), config.json "
                        "implies (64, 32)")),
    ("no tokenizer", "lacks tokenizer.json"),
    ("corrupt tokenizer", "not a readable tokenizer.json"),
    ("no weights", "no model.safetensors or model.safetensors.index.json"),
    ("missing shard", "checkpoint file not found: .*model-00001-of-00001.safetensors"),
    ("truncated", "model.safetensors: not a readable safetensors file"),
    ("missing tensor", "lacks tensor 'model.layers.1.mlp.up_proj.weight'"),
    ("int8", "'model.norm.weight' is torch.int8"),
])
def test_bad_checkpoints_fail_with_one_line(tmp_path: Path, how: str, message: str) -> None:
    directory = _tiny_checkpoint(tmp_path / "ckpt")
    _break(directory, how)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(directory, torch.float32, "cpu", progress=False)
    assert "\n" not in str(info.value)


def test_cli_reports_a_bad_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from muser.cli import main

    directory = _tiny_checkpoint(tmp_path / "ckpt")
    _break(directory, "truncated")
    assert main(["generate", "hi", "--model", str(directory), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the startup phase lines
    assert err.startswith("muser: error: ") and "not a readable safetensors" in err
