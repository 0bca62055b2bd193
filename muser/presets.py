"""Named synthetic model shapes, for `--load-format dummy`: the published Gemma 3 and Gemma 4
text models, and muse-glimmer, the hybrid shape of the book muser's design comes from.

Gemma 3 shapes follow transformers' Gemma3TextConfig for each released checkpoint: every 6th
layer is global (5:1), RoPE base 1e6 on global layers (linear scaling 8 from 4B up) and 1e4 on
sliding layers, queries scaled by head_dim ** -0.5 except the 27B (hidden / heads = 168).

Gemma 4 shapes follow google-deepmind/gemma's own definitions (gemma/gm/nn/gemma4/_gemma4.py):
a 262,144-token vocabulary, head size 256 on sliding layers and 512 on full ones, RoPE base
1e4 on sliding layers and 1e6 turning a quarter of the angle pairs on full ones, final logit
soft cap 30, MLPs 4 * hidden wide (the MoE's dense MLP 2,112). E2B: 35 layers 4:1 (window 512),
the last 20 sharing KV, whose MLPs are twice as wide, PLE of 256 a layer; E4B: 42 layers 5:1
(window 512), the last 18 sharing KV, PLE of 256; 31B: 60 layers 5:1 (window 1,024), K=V on the
full layers with 4 KV heads; 26B-A4B: 30 layers 5:1 (window 1,024), K=V with 2 KV heads, 8 of
128 experts of 704 per token beside the dense MLP.

muse-glimmer keeps what the book states: 52 layers, 39 sliding and 13 full-attention ones (3:1),
no positional encoding on the full layers (NoPE), head_dim 128, a window of 2,048 (its boundary
checks sit at 2,047-2,049), 27,854,794,240 parameters counted as embedding table + projections.
The rest is chosen to meet that count with Gemma 3's 262,144-token vocabulary (so the embedded
tokenizer serves it): hidden 5,120 (a 1.34 B embedding, the book's 1.35 B), 48 query heads and
8 KV heads, intermediate 28,416, tied head: 27,856,504,832 parameters (num_parameters), 0.006 %
above the book's.
"""

from __future__ import annotations

from muser.config import ModelConfig, gemma3_layer_kinds

# name: (layers, hidden, intermediate, heads, kv heads, head dim, window, rope scaling, vocab,
#        global every n-th layer, NoPE on global layers)
_SHAPES = {
    "gemma3-270m": (18, 640, 2048, 4, 1, 256, 512, 1.0, 262144, 6, False),
    "gemma3-1b": (26, 1152, 6912, 4, 1, 256, 512, 1.0, 262144, 6, False),
    "gemma3-4b": (34, 2560, 10240, 8, 4, 256, 1024, 8.0, 262144, 6, False),
    "gemma3-12b": (48, 3840, 15360, 16, 8, 256, 1024, 8.0, 262144, 6, False),
    "gemma3-27b": (62, 5376, 21504, 32, 16, 128, 1024, 8.0, 262208, 6, False),
    "muse-glimmer": (52, 5120, 28416, 48, 8, 128, 2048, 1.0, 262144, 4, True),
}
# name: (layers, hidden, intermediate, heads, KV heads, full layers' KV heads (with K=V; None:
#        the others', no K=V), window, full every n-th layer, KV-sharing layers, PLE size,
#        double-wide MLP, (experts, routed per token, expert width))
_GEMMA4 = {
    "gemma4-e2b": (35, 1536, 6144, 8, 1, None, 512, 5, 20, 256, True, None),
    "gemma4-e4b": (42, 2560, 10240, 8, 2, None, 512, 6, 18, 256, False, None),
    "gemma4-31b": (60, 5376, 21504, 32, 16, 4, 1024, 6, 0, 0, False, None),
    "gemma4-26b-a4b": (30, 2816, 2112, 16, 8, 2, 1024, 6, 0, 0, False, (128, 8, 704)),
}
PRESETS = (*_SHAPES, *_GEMMA4)


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a named shape (e.g. 'gemma3-1b')."""
    if name in _GEMMA4:
        return _gemma4(*_GEMMA4[name])
    if name not in _SHAPES:
        raise ValueError(f"unknown model config '{name}' (known: {', '.join(PRESETS)})")
    layers, hidden, inter, heads, kv_heads, head_dim, window, scaling, vocab, pattern, nope = (
        _SHAPES[name])
    scalar = hidden / heads if name == "gemma3-27b" else head_dim
    return ModelConfig(
        architecture="gemma3", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        layer_kinds=gemma3_layer_kinds(layers, pattern), sliding_window=window, rope_theta=1e6,
        rope_local_theta=1e4, rope_scaling_factor=scaling, query_pre_attn_scalar=float(scalar),
        max_position_embeddings=32768 if name in ("gemma3-270m", "gemma3-1b") else 131072,
        nope_kinds=frozenset({"global"}) if nope else frozenset(),
    )


def _gemma4(layers: int, hidden: int, inter: int, heads: int, kv_heads: int,
            full_kv_heads: int | None, window: int, pattern: int, shared: int, ple: int,
            double_wide: bool, experts: tuple[int, int, int] | None) -> ModelConfig:
    num, top_k, expert_size = experts or (0, 0, 0)
    return ModelConfig(
        architecture="gemma4", vocab_size=262144, hidden_size=hidden, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=256,
        layer_kinds=gemma3_layer_kinds(layers, pattern), sliding_window=window, rope_theta=1e6,
        rope_local_theta=1e4, query_pre_attn_scalar=1.0, max_position_embeddings=131072,
        final_logit_softcapping=30.0, global_head_dim=512,
        global_num_kv_heads=full_kv_heads or kv_heads, rope_fraction=0.25,
        k_eq_v_kinds=frozenset({"global"}) if full_kv_heads else frozenset(),
        v_norm=True, per_layer_input_size=ple, per_layer_vocab_size=262144 if ple else 0,
        num_kv_shared_layers=shared, double_wide_mlp=double_wide, num_experts=num,
        top_k_experts=top_k, moe_intermediate_size=expert_size,
    )


def num_parameters(cfg: ModelConfig) -> int:
    """Parameters as the book counts them: the embedding table and every projection matrix
    (a tied head counted once), plus the norm gains (Gemma 3's layout: Gemma 4's parts are
    not counted)."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    matrices = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    norms = 4 * h + 2 * cfg.head_dim
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + head + cfg.num_layers * (matrices + norms) + h
