"""GGUF tensor names -> layer-graph weight names (data, one table per family), and which of a
table's tensors a Gemma 4 layer holds."""

from __future__ import annotations

from muser.config import ModelConfig

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
# MoeWeights field -> a mixture-of-experts layer's tensor (after 'layers.{i}.'); gate_up and down
# are [experts, rows, columns], one matrix per expert
HF_GEMMA4_MOE_NAMES = {
    "router": "router.proj.weight", "router_scale": "router.scale",
    "expert_scale": "router.per_expert_scale", "gate_up": "experts.gate_up_proj",
    "down": "experts.down_proj", "pre_norm": "pre_feedforward_layernorm_2.weight",
    "post_norm": "post_feedforward_layernorm_2.weight",
    "post_dense_norm": "post_feedforward_layernorm_1.weight",
}
HF_GEMMA4_PLE_NAMES = {  # the per-layer inputs' tensors (PLE), beside HF_GLOBAL_NAMES
    "embed_tokens_per_layer.weight": "per_layer_embed",
    "per_layer_model_projection.weight": "per_layer_model_proj",
    "per_layer_projection_norm.weight": "per_layer_proj_norm",
}
# Gemma 4's norms multiply by the stored w (Gemma 3's by 1 + w); these fields load as stored
GEMMA4_AS_STORED = NORMS | {"per_layer_norm", "layer_scalar"}

# GGUF Gemma 4 (llama.cpp's `gemma4` architecture), as LAYER_NAMES and GLOBAL_NAMES: gains are
# stored as Gemma 4 multiplies by them (no 1 + w), the layer scalar as a [1] tensor
GEMMA4_LAYER_NAMES: dict[str, str | list[str]] = LAYER_NAMES | {
    "per_layer_gate": "inp_gate.weight",
    "per_layer_proj": "proj.weight",
    "per_layer_norm": "post_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
}
GEMMA4_PLE_NAMES = {
    "per_layer_token_embd.weight": "per_layer_embed",
    "per_layer_model_proj.weight": "per_layer_model_proj",
    "per_layer_proj_norm.weight": "per_layer_proj_norm",
}
GEMMA4_MOE_NAMES = {  # as HF_GEMMA4_MOE_NAMES; the router's per-expert scale is the down's
    "router": "ffn_gate_inp.weight", "router_scale": "ffn_gate_inp.scale",
    "expert_scale": "ffn_down_exps.scale", "gate_up": "ffn_gate_up_exps.weight",
    "down": "ffn_down_exps.weight", "pre_norm": "pre_ffw_norm_2.weight",
    "post_norm": "post_ffw_norm_2.weight", "post_dense_norm": "post_ffw_norm_1.weight",
}
GGUF_LM_HEAD = "output.weight"  # stored only when the head is not tied to the embedding
GGUF_ROPE_FREQS = "rope_freqs.weight"  # full layers' frequency divisors (proportional RoPE)
MOE_EXPERTS = {"gate_up", "down"}  # MoeWeights fields of one matrix per expert
MOE_GAINS = {"router_scale", "expert_scale", "pre_norm", "post_norm", "post_dense_norm"}


def gemma4_layer_names(table: dict[str, str | list[str]], cfg: ModelConfig,
                       layer_id: int) -> dict[str, list[str]]:
    """LayerWeights field -> the tensors of `table` (names after the layer's prefix) layer
    `layer_id` holds, rows concatenated in order: a K=V kind has no value projection, a
    KV-sharing layer neither keys nor values nor k_norm (it reads its owner's cache), PLE's
    tensors only with PLE."""
    names = {f: [n] if isinstance(n, str) else n for f, n in table.items()}
    if cfg.kv_owner(layer_id) != layer_id:
        names["qkv"] = names["qkv"][:1]
        del names["k_norm"]
    elif cfg.layer_kinds[layer_id] in cfg.k_eq_v_kinds:
        names["qkv"] = names["qkv"][:2]
    if not cfg.per_layer_input_size:
        for field in ("per_layer_gate", "per_layer_proj", "per_layer_norm"):
            del names[field]
    return names
