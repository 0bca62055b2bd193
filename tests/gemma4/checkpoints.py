"""Tiny random Gemma 4 checkpoints written by transformers itself (its Gemma4ForCausalLM's
save_pretrained), one per variant muser runs, and transformers' float32 logits of them.

Weights are drawn again (seeded) before saving, at scales that make every part matter: gains
near 1 (Gemma 4 multiplies by the stored w, the router's input gain too), layer scalars and
per-expert scales in [0.5, 1.5], unit-variance embeddings (logits of a few units, spread over
the soft cap) and router rows (expert scores of a few units: routing far from ties), and
matrices scaled by 1 / sqrt(fan-in); transformers' own initialization (std 0.02, gains and scalars 1) leaves
logits near 0 and the layer scalars out."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma4AudioConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
)

from tests.test_hf_loading import _tiny_tokenizer

W = 8  # sliding window
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING, FULL]
BASE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
    "layer_types": LAYER_TYPES, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "global_head_dim": 32, "sliding_window": W, "max_position_embeddings": 256,
    "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
}
VARIANTS = {
    # full layers: their own head size (32 against 16), proportional RoPE on a quarter of it
    "dense": {},
    # values from the key projection on the full layers, with their own KV heads (1)
    "k_eq_v": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    # E-series: per-layer inputs, the last 3 layers (full, sliding, full) reading the caches of
    # layers 2 and 4, their MLPs twice as wide; and an untied head
    "ple_shared": {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512,
                   "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
                   "tie_word_embeddings": False},
    # 26B-A4B's block: beside every layer's MLP, 2 of 4 routed experts per token
    "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
            "moe_intermediate_size": 32},
}


def reference_model(variant: str) -> Gemma4ForCausalLM:
    """transformers' float32 model of `variant`, eager attention, seeded weights."""
    cfg = Gemma4TextConfig(**BASE | VARIANTS[variant], attn_implementation="eager")
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(("layer_scalar", "per_expert_scale")):
                t.copy_(0.5 + torch.rand(t.shape, generator=gen))
            elif "norm" in name or name.endswith("router.scale"):
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
            elif "embed_tokens" in name or name.endswith("router.proj.weight"):
                t.copy_(torch.randn(t.shape, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5)
    return model


def write_checkpoint(variant: str, directory: Path) -> Path:
    """The variant's checkpoint (config.json, model.safetensors, a tiny tokenizer.json)."""
    reference_model(variant).save_pretrained(directory)
    _tiny_tokenizer(directory)
    return directory


def write_multimodal(directory: Path) -> Gemma4ForConditionalGeneration:
    """A Gemma4ForConditionalGeneration checkpoint: the dense variant's text model (seeded as
    reference_model's) beside tiny vision and audio towers -> transformers' model of it."""
    text = Gemma4TextConfig(**BASE)
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    audio = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              output_proj_dims=64)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision,
                                                        audio_config=audio)).eval()
    text_model = reference_model("dense").model
    model.model.language_model.load_state_dict(text_model.state_dict())
    model.save_pretrained(directory)
    _tiny_tokenizer(directory)
    return model
