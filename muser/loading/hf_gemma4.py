"""Gemma 4's config.json (Gemma4ForCausalLM, or the text_config of
Gemma4ForConditionalGeneration) -> ModelConfig: the dense text models, per-layer inputs (PLE),
KV sharing, K=V and the mixture of experts (enable_moe_block) included."""

from __future__ import annotations

from typing import Any

from muser.config import LayerKind, ModelConfig, gemma3_layer_kinds
from muser.errors import ModelLoadError

ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
# transformers' Gemma4TextConfig defaults (configuration_gemma4.py): a config.json lists what
# differs from them. global_head_dim and num_global_key_value_heads are read by its
# __post_init__ (the full layers' per_layer_config); transformers' own saves write that instead.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_parameters": None,
    "attention_bias": False, "sliding_window": 512, "layer_types": None,
    "final_logit_softcapping": None, "use_bidirectional_attention": None,
    "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False, "num_kv_shared_layers": 0, "enable_moe_block": False,
    "use_double_wide_mlp": False, "global_head_dim": 512, "num_global_key_value_heads": None,
    "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None,
}
ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}
_KINDS: dict[str, LayerKind] = {"sliding_attention": "sliding", "full_attention": "global"}


def config_from_gemma4(text: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a Gemma 4 text config (the text_config of a multimodal one)."""
    text = TEXT_DEFAULTS | text
    for key, value in (("hidden_activation", "gelu_pytorch_tanh"), ("attention_bias", False),
                       ("use_bidirectional_attention", None)):
        if text[key] != value:
            raise ModelLoadError(f"config.json: {key} = {text[key]!r} is not supported")
    num_layers = int(text["num_hidden_layers"])
    kinds = _layer_kinds(text["layer_types"], num_layers)
    head_dim, kv_heads = int(text["head_dim"]), int(text["num_key_value_heads"])
    global_head_dim, global_kv_heads = _full_geometry(text, kinds, head_dim, kv_heads)
    theta, local_theta, scaling, fraction = _rope(text["rope_parameters"] or ROPE_DEFAULTS)
    ple = int(text["hidden_size_per_layer_input"] or 0)
    try:
        return ModelConfig(
            architecture="gemma4", vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]), num_layers=num_layers,
            num_heads=int(text["num_attention_heads"]), num_kv_heads=kv_heads,
            head_dim=head_dim, layer_kinds=kinds, sliding_window=int(text["sliding_window"]),
            rope_theta=theta, rope_local_theta=local_theta, rope_scaling_factor=scaling,
            rms_norm_eps=float(text["rms_norm_eps"]),
            query_pre_attn_scalar=1.0,  # Gemma 4 does not scale its scores (QK-norm does)
            max_position_embeddings=int(text["max_position_embeddings"]),
            tie_word_embeddings=bool(text["tie_word_embeddings"]),
            final_logit_softcapping=text["final_logit_softcapping"],
            global_head_dim=global_head_dim, global_num_kv_heads=global_kv_heads,
            rope_fraction=fraction,
            k_eq_v_kinds=frozenset({"global"}) if text["attention_k_eq_v"] else frozenset(),
            v_norm=True, per_layer_input_size=ple,
            per_layer_vocab_size=int(text["vocab_size_per_layer_input"]) if ple else 0,
            num_kv_shared_layers=int(text["num_kv_shared_layers"]),
            double_wide_mlp=bool(text["use_double_wide_mlp"]), **_experts(text),
        )
    except ValueError as exc:
        raise ModelLoadError(f"config.json: {exc}") from None


def _experts(text: dict[str, Any]) -> dict[str, int]:
    """ModelConfig's mixture-of-experts fields: none without enable_moe_block, else all three
    keys (a missing one is an error)."""
    if not text["enable_moe_block"]:
        return {}
    keys = ("num_experts", "top_k_experts", "moe_intermediate_size")
    missing = [key for key in keys if text[key] is None]
    if missing:
        raise ModelLoadError(f"config.json: enable_moe_block without {', '.join(missing)}")
    return {key: int(text[key]) for key in keys}


def _layer_kinds(types: list[str] | None, num_layers: int) -> tuple[LayerKind, ...]:
    """layer_types, or every 6th layer full (transformers' default); as transformers, the last
    layer attends fully whatever the list says."""
    if types is None:
        kinds = list(gemma3_layer_kinds(num_layers, 6))
    else:
        unknown = set(types) - set(_KINDS)
        if unknown or len(types) != num_layers:
            raise ModelLoadError(f"config.json: layer_types must name {num_layers} layers of "
                                 f"{' or '.join(_KINDS)}, got {len(types)} ({sorted(unknown)})")
        kinds = [_KINDS[t] for t in types]
    kinds[-1] = "global"
    return tuple(kinds)


def _full_geometry(text: dict[str, Any], kinds: tuple[LayerKind, ...], head_dim: int,
                   kv_heads: int) -> tuple[int, int]:
    """(head dim, KV heads) of the full layers: per_layer_config (transformers' own saves) or
    global_head_dim / num_global_key_value_heads (the published configs; the KV heads only
    with attention_k_eq_v, as transformers reads them). One geometry a kind, or an error."""
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        dim = int(text["global_head_dim"])
        heads = text["num_global_key_value_heads"] if text["attention_k_eq_v"] else None
        return dim, int(heads) if heads is not None else kv_heads
    found: dict[LayerKind, set[tuple[int, int]]] = {"sliding": set(), "global": set()}
    for layer_id, kind in enumerate(kinds):
        override = dict(per_layer.get(str(layer_id), per_layer.get(layer_id)) or {})
        extra = set(override) - {"head_dim", "num_key_value_heads"}
        if extra:
            raise ModelLoadError(f"config.json: per_layer_config of layer {layer_id} sets "
                                 f"{sorted(extra)}, which muser does not read")
        found[kind].add((int(override.get("head_dim", head_dim)),
                         int(override.get("num_key_value_heads", kv_heads))))
    if found["sliding"] - {(head_dim, kv_heads)} or len(found["global"]) > 1:
        raise ModelLoadError("config.json: per_layer_config gives layers of one kind different "
                             "geometries; muser carries one per kind")
    return found["global"].pop() if found["global"] else (head_dim, kv_heads)


def _rope(params: dict[str, Any]) -> tuple[float, float, float, float]:
    """(full theta, sliding theta, full scaling, full rotated fraction) from rope_parameters:
    'default' or 'proportional' on full layers, 'default' on sliding ones."""
    full = params.get("full_attention") or ROPE_DEFAULTS["full_attention"]
    local = params.get("sliding_attention") or ROPE_DEFAULTS["sliding_attention"]
    for name, p, allowed in (("full", full, ("default", "proportional")),
                             ("sliding", local, ("default",))):
        if p.get("rope_type", "default") not in allowed:
            raise ModelLoadError(f"config.json: rope type '{p['rope_type']}' on {name} layers "
                                 f"is not supported (supported: {', '.join(allowed)})")
    proportional = full.get("rope_type") == "proportional"
    return (float(full.get("rope_theta", 1e6)), float(local.get("rope_theta", 1e4)),
            float(full.get("factor", 1.0)) if proportional else 1.0,
            float(full.get("partial_rotary_factor", 1.0)) if proportional else 1.0)
