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

# Hugging Face Gemma 3 names, after the text model's prefix ("model." for Gemma3ForCausalLM,
# "language_model.model." or "model.language_model." for Gemma3ForConditionalGeneration).
HF_GLOBAL_NAMES = {"embed_tokens.weight": "embed", "norm.weight": "final_norm"}
HF_LM_HEAD = "lm_head.weight"  # stored only when the head is not tied to the embedding

# layers.{i}.<HF name> -> LayerWeights field, as LAYER_NAMES.
HF_LAYER_NAMES: dict[str, str | list[str]] = {
    "attn_norm": "input_layernorm.weight",
    "qkv": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "down": "mlp.down_proj.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
}

# Hugging Face Gemma 4 names, after the text model's prefix ("model." for Gemma4ForCausalLM,
# "model.language_model." for Gemma4ForConditionalGeneration): Gemma 3's, the qkv list cut to
# what a layer projects (muser/loading/hf.py, _layer_names), and the parts Gemma 4 adds.
HF_GEMMA4_LAYER_NAMES: dict[str, str | list[str]] = HF_LAYER_NAMES | {
    "per_layer_gate": "per_layer_input_gate.weight",
    "per_layer_proj": "per_layer_projection.weight",
    "per_layer_norm": "post_per_layer_input_norm.weight",
    "layer_scalar": "layer_scalar",
}
HF_GEMMA4_PLE_NAMES = {  # the per-layer inputs' tensors (PLE), beside HF_GLOBAL_NAMES
    "embed_tokens_per_layer.weight": "per_layer_embed",
    "per_layer_model_projection.weight": "per_layer_model_proj",
    "per_layer_projection_norm.weight": "per_layer_proj_norm",
}
# Gemma 4's norms multiply by the stored w (Gemma 3's by 1 + w); these fields load as stored
GEMMA4_AS_STORED = NORMS | {"per_layer_norm", "layer_scalar"}
