"""Write a GGUF model out as a Hugging Face checkpoint (config.json, sharded float32
safetensors, tokenizer.json, tokenizer_config.json), so the HF loader is tested on real weights
offline. Float32 holds every dequantized GGUF weight exactly, and Gemma's norms are written as
w = g - 1 (the file stores g = 1 + w): exact for these gains, asserted as they are written."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from muser.config import ModelConfig
from muser.loading.gguf import config_from_gguf
from muser.loading.names import GLOBAL_NAMES, HF_GLOBAL_NAMES, HF_LAYER_NAMES, LAYER_NAMES, NORMS
from muser.ops.quants import dequantize
from muser.tokenizer import TYPE_CONTROL, TYPE_NORMAL, TYPE_USER_DEFINED

# A short Gemma-style template (the GGUF carries none); {{ bos_token }} as the official one.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                 "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                 "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def hf_names() -> dict[str, tuple[str, bool]]:
    """GGUF tensor name pattern -> (HF name pattern, is a norm); '{i}' is the layer."""
    hf_global = {field: h for h, field in HF_GLOBAL_NAMES.items()}
    out = {g: (f"model.{hf_global[field]}", field == "final_norm")
           for g, field in GLOBAL_NAMES.items()}
    for field, gguf_names in LAYER_NAMES.items():
        hf = HF_LAYER_NAMES[field]
        pairs = zip(gguf_names, hf) if isinstance(gguf_names, list) else [(gguf_names, hf)]
        out.update({f"blk.{{i}}.{g}": (f"model.layers.{{i}}.{h}", field in NORMS)
                    for g, h in pairs})
    return out


def hf_tensors(reader: gguf.GGUFReader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF, dequantized to float32, under its HF name."""
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for g, (h, is_norm) in hf_names().items():
        for i in range(cfg.num_layers) if "{i}" in g else [None]:
            t = tensors[g.format(i=i)]
            raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))
            w = dequantize(raw, t.tensor_type, tuple(int(d) for d in reversed(t.shape)))
            if is_norm:
                gain, w = w, w - 1.0
                assert torch.equal(1.0 + w, gain), f"{t.name}: 1 + (g - 1) != g"
            out[h.format(i=i)] = w.clone()
    return out


def hf_config(cfg: ModelConfig) -> dict:
    """config.json of a Gemma3ForCausalLM in the layout of the released 270M's."""
    kinds = {"sliding": "sliding_attention", "global": "full_attention"}
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "layer_types": [kinds[k] for k in cfg.layer_kinds],
        "sliding_window": cfg.sliding_window, "rope_theta": cfg.rope_theta,
        "rope_local_base_freq": cfg.rope_local_theta, "rope_scaling": None,
        "rms_norm_eps": cfg.rms_norm_eps, "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_activation":
        "gelu_pytorch_tanh", "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "float32",
    }


def write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """model-0000k-of-0000n.safetensors and their index (one model.safetensors if n == 1)."""
    names = list(tensors)
    if num_shards == 1:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for k in range(num_shards):
        file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[k * len(names) // num_shards:(k + 1) * len(names) // num_shards]
        save_file({n: tensors[n] for n in part}, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def write_tokenizer(directory: Path, reader: gguf.GGUFReader) -> None:
    """tokenizer.json as a byte-fallback BPE whose merges rank pairs by the score of the
    piece they make (SentencePiece's merge order), control and user-defined tokens added;
    tokenizer_config.json with the special tokens and CHAT_TEMPLATE."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    scores = reader.fields["tokenizer.ggml.scores"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sorted((-scores[i], vocab[p[:k]], vocab[p[k:]], p[:k], p[k:])
                    for i, p in enumerate(tokens) if types[i] == TYPE_NORMAL
                    for k in range(1, len(p)) if p[:k] in vocab and p[k:] in vocab)
    hf = Tokenizer(BPE(vocab, [m[3:] for m in merges], unk_token="<unk>", fuse_unk=True,
                       byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    hf.add_tokens([AddedToken(t, special=types[i] == TYPE_CONTROL, normalized=False)
                   for i, t in enumerate(tokens) if types[i] in (TYPE_CONTROL, TYPE_USER_DEFINED)])
    hf.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True,
                "add_eos_token": False, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


def export_hf(reader: gguf.GGUFReader, directory: Path, num_shards: int = 2) -> Path:
    """The GGUF model as a Hugging Face checkpoint directory."""
    cfg = config_from_gguf(reader)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    write_safetensors(directory, hf_tensors(reader, cfg), num_shards)
    write_tokenizer(directory, reader)
    return directory


def hf_model(reader: gguf.GGUFReader) -> torch.nn.Module:
    """The GGUF model as transformers' float32 Gemma3ForCausalLM (eager attention), in memory:
    the weights of hf_tensors, nothing written to disk."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.initialization import no_init_weights

    settings = {k: v for k, v in hf_config(config_from_gguf(reader)).items()
                if k not in ("architectures", "model_type", "torch_dtype")}
    settings["query_pre_attn_scalar"] = int(settings["query_pre_attn_scalar"])  # an int field
    config = Gemma3TextConfig(**settings)
    config._attn_implementation = "eager"
    with no_init_weights():
        model = Gemma3ForCausalLM(config)
    missing = model.load_state_dict(hf_tensors(reader, config_from_gguf(reader)), strict=False)
    assert missing.missing_keys == ["lm_head.weight"] and not missing.unexpected_keys  # tied
    return model.eval()
