"""The Gemma 4 presets (muser/presets.py) are what muser reads from a config.json of the same
shapes in transformers' keys (google-deepmind/gemma's definitions written as Gemma4TextConfig
fields), and dummy weights of their parts have the shapes the graph reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from muser.graph.weights import qkv_rows, random_weights
from muser.loading.hf import config_from_hf
from muser.presets import preset

SLIDING, FULL = "sliding_attention", "full_attention"


def _types(layers: int, pattern: int) -> list[str]:
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]


COMMON = {"vocab_size": 262144, "head_dim": 256, "global_head_dim": 512,
          "final_logit_softcapping": 30.0, "max_position_embeddings": 131072}
PUBLISHED = {
    "gemma4-e2b": {"num_hidden_layers": 35, "hidden_size": 1536, "intermediate_size": 6144,
                   "num_attention_heads": 8, "num_key_value_heads": 1, "sliding_window": 512,
                   "layer_types": _types(35, 5), "num_kv_shared_layers": 20,
                   "hidden_size_per_layer_input": 256, "use_double_wide_mlp": True},
    "gemma4-e4b": {"num_hidden_layers": 42, "hidden_size": 2560, "intermediate_size": 10240,
                   "num_attention_heads": 8, "num_key_value_heads": 2, "sliding_window": 512,
                   "layer_types": _types(42, 6), "num_kv_shared_layers": 18,
                   "hidden_size_per_layer_input": 256},
    "gemma4-31b": {"num_hidden_layers": 60, "hidden_size": 5376, "intermediate_size": 21504,
                   "num_attention_heads": 32, "num_key_value_heads": 16, "sliding_window": 1024,
                   "layer_types": _types(60, 6), "attention_k_eq_v": True,
                   "num_global_key_value_heads": 4, "hidden_size_per_layer_input": 0},
    "gemma4-26b-a4b": {"num_hidden_layers": 30, "hidden_size": 2816, "intermediate_size": 2112,
                       "num_attention_heads": 16, "num_key_value_heads": 8,
                       "sliding_window": 1024, "layer_types": _types(30, 6),
                       "attention_k_eq_v": True, "num_global_key_value_heads": 2,
                       "hidden_size_per_layer_input": 0, "enable_moe_block": True,
                       "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_is_its_config_json(name: str) -> None:
    config = {"architectures": ["Gemma4ForCausalLM"]} | COMMON | PUBLISHED[name]
    assert config_from_hf(config) == preset(name)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_dummy_weights_of_a_preset_have_the_graph_s_shapes(name: str) -> None:
    """Every part of the preset, at a sixteenth of its widths, two layers of each kind."""
    cfg = preset(name)
    small = dataclasses.replace(
        cfg, vocab_size=64, hidden_size=cfg.hidden_size // 16,
        intermediate_size=cfg.intermediate_size // 16, num_layers=4,
        layer_kinds=("sliding", "global", "sliding", "global"),
        num_kv_shared_layers=2 if cfg.num_kv_shared_layers else 0, per_layer_vocab_size=(
            64 if cfg.per_layer_input_size else 0),
        num_experts=min(cfg.num_experts, 16), top_k_experts=min(cfg.top_k_experts, 4))
    w = random_weights(small, torch.float32, "cpu")
    for i, layer in enumerate(w.layers):
        assert layer.qkv.shape == (qkv_rows(small, i), small.hidden_size)
        assert layer.down.shape == (small.hidden_size, small.intermediate_of(i))
        assert (layer.moe is None) == (not cfg.num_experts)
        if layer.moe is not None:
            assert len(layer.moe.gate_up) == small.num_experts
            assert layer.moe.down[0].shape == (small.hidden_size, cfg.moe_intermediate_size)
