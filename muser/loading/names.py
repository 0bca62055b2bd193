"""GGUF tensor names -> layer-graph weight names (data, one table per family)."""

from __future__ import annotations

GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm"}

# blk.{i}.<gguf name> -> LayerWeights field; a list means "concatenate rows in this order".
LAYER_NAMES: dict[str, str | list[str]] = {
    "attn_norm": "attn_norm.weight",
    "qkv": ["attn_q.weight", "attn_k.weight", "attn_v.weight"],
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "o_proj": "attn_output.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "gate_up": ["ffn_gate.weight", "ffn_up.weight"],
    "down": "ffn_down.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
}

NORMS = {"attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm"}
