"""A GGUF file of a tiny Gemma 4 checkpoint (tests/gemma4/checkpoints.py), written as llama.cpp's
convert_hf_to_gguf.py writes the `gemma4` architecture: its metadata keys, gguf-py's own tensor
name map (MODEL_ARCH.GEMMA4), gains as stored, the layer scalar as a [1] tensor, the router's
scales as ffn_gate_inp.scale and ffn_down_exps.scale, rope_freqs for the full layers'
proportional RoPE, and the tokenizer as model `gemma4` (tokens, merges). Two departures, both
for the tiny files: the full layers' geometry is read from per_layer_config (transformers'
saves hold it, not global_head_dim), and the 263-token tokenizer is padded to the
embedding's rows with unused tokens (as the converter's get_vocab_base pads), so logits keep
their width.

`qtype` Q8_0 stores every matrix whose rows are whole blocks of 32 as Q8_0 (the rest F32, as
the converter falls back); `dequantized` gives the values a Q8_0 matrix stands for."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCH = gguf.MODEL_ARCH.GEMMA4
F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
UNROTATED = 1e30


def write_gguf(checkpoint: Path, path: Path, qtype: gguf.GGMLQuantizationType = F32) -> Path:
    """The checkpoint directory's model as a `gemma4` GGUF file at `path`."""
    config = json.loads((checkpoint / "config.json").read_text("utf-8"))  # as saved: every key
    geometry = _full_geometry(config)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCH])
    _metadata(writer, config, geometry)
    _tokenizer(writer, checkpoint, config["vocab_size"])
    names = gguf.get_tensor_name_map(ARCH, config["num_hidden_layers"])
    for name, t in load_file(checkpoint / "model.safetensors").items():
        gguf_name, t = _tensor(names, name, t)
        data = t.float().numpy()
        if qtype != F32 and _quantizable(gguf_name, data):
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, data)
    writer.add_tensor("rope_freqs.weight", _rope_freqs(config, geometry[0]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized(t: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """The values a tensor stands for once stored as `qtype` (what gguf dequantizes)."""
    data = t.float().numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype))


def _quantizable(gguf_name: str, data: np.ndarray) -> bool:
    """A matrix (not a gain, a scale or the layer scalar) whose rows are whole Q8_0 blocks."""
    gains = ("norm", "scale", "layer_output_scale")
    return data.ndim >= 2 and data.shape[-1] % 32 == 0 and not any(g in gguf_name for g in gains)


def _tensor(names: gguf.TensorNameMap, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """convert_hf_to_gguf's Gemma4Model: filter_tensors' suffixes, modify_tensors' renames."""
    bid = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("router.scale"):
        return f"blk.{bid}.ffn_gate_inp.scale", t
    if name.endswith("router.per_expert_scale"):
        return f"blk.{bid}.ffn_down_exps.scale", t
    if name.endswith("layer_scalar") or ".experts." in name:
        name += ".weight"
    mapped = names.get_name(name, try_suffixes=(".weight",))
    assert mapped is not None, name
    return mapped, t


def _metadata(w: gguf.GGUFWriter, c: dict, geometry: tuple[int, int]) -> None:
    """TextModel's, Gemma3Model's and Gemma4Model's set_gguf_parameters."""
    full = {i for i, t in enumerate(c["layer_types"]) if t == "full_attention"}
    head_dim_full, kv_full = geometry
    rope = c["rope_parameters"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    layers = range(c["num_hidden_layers"])
    kv = [kv_full if i in full else c["num_key_value_heads"] for i in layers]
    w.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if c["final_logit_softcapping"]:
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])
    shared = c["num_kv_shared_layers"]
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c["hidden_size_per_layer_input"] or 0)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
    w.add_key_length(head_dim_full)
    w.add_value_length(head_dim_full)
    w.add_key_length_swa(c["head_dim"])
    w.add_value_length_swa(c["head_dim"])
    first_shared = c["num_hidden_layers"] - shared
    n_ff = c["intermediate_size"]
    w.add_feed_forward_length([n_ff if i < first_shared else 2 * n_ff for i in layers]
                              if c["use_double_wide_mlp"] else n_ff)
    w.add_rope_dimension_count(head_dim_full)
    w.add_rope_dimension_count_swa(c["head_dim"])
    if c["enable_moe_block"]:
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["top_k_experts"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _full_geometry(c: dict) -> tuple[int, int]:
    """(head dim, KV heads) of the full layers, from the saved per_layer_config."""
    full = next(i for i, t in enumerate(c["layer_types"]) if t == "full_attention")
    override = c["per_layer_config"].get(str(full), {})
    return (int(override.get("head_dim", c["head_dim"])),
            int(override.get("num_key_value_heads", c["num_key_value_heads"])))


def _rope_freqs(c: dict, head_dim: int) -> np.ndarray:
    """Gemma4Model.generate_extra_tensors: 1 on the rotated angle pairs, 1e30 on the rest."""
    rotated = int(head_dim * c["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    return np.array([1.0] * rotated + [UNROTATED] * (head_dim // 2 - rotated), np.float32)


def _tokenizer(w: gguf.GGUFWriter, checkpoint: Path, num_rows: int) -> None:
    """Gemma4Model.set_vocab over tokenizer.json: tokens by id, their types, the merges."""
    spec = json.loads((checkpoint / "tokenizer.json").read_text("utf-8"))
    tokens = [f"[PAD{i}]" for i in range(num_rows)]
    types = [gguf.TokenType.UNUSED] * num_rows
    for text, i in spec["model"]["vocab"].items():
        is_byte = text.startswith("<0x") and len(text) == 6
        tokens[i], types[i] = text, gguf.TokenType.BYTE if is_byte else gguf.TokenType.NORMAL
    for added in spec["added_tokens"]:
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else (
            gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * num_rows)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m
                        for m in spec["model"]["merges"]])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
