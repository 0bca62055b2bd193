"""Named synthetic model shapes: the published Gemma 3 text models, for `--load-format dummy`.

Shapes follow transformers' Gemma3TextConfig for each released checkpoint: every 6th layer is
global (5:1), RoPE base 1e6 on global layers (linear scaling 8 from 4B up) and 1e4 on sliding
layers, queries scaled by head_dim ** -0.5 except the 27B (hidden / heads = 168).
"""

from __future__ import annotations

from muser.config import ModelConfig, gemma3_layer_kinds

# name: (layers, hidden, intermediate, heads, kv heads, head dim, window, rope scaling, vocab)
_SHAPES = {
    "gemma3-270m": (18, 640, 2048, 4, 1, 256, 512, 1.0, 262144),
    "gemma3-1b": (26, 1152, 6912, 4, 1, 256, 512, 1.0, 262144),
    "gemma3-4b": (34, 2560, 10240, 8, 4, 256, 1024, 8.0, 262144),
    "gemma3-12b": (48, 3840, 15360, 16, 8, 256, 1024, 8.0, 262144),
    "gemma3-27b": (62, 5376, 21504, 32, 16, 128, 1024, 8.0, 262208),
}
PRESETS = tuple(_SHAPES)


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a named Gemma 3 text model (e.g. 'gemma3-1b')."""
    if name not in _SHAPES:
        raise ValueError(f"unknown model config '{name}' (known: {', '.join(PRESETS)})")
    layers, hidden, inter, heads, kv_heads, head_dim, window, scaling, vocab = _SHAPES[name]
    scalar = hidden / heads if name == "gemma3-27b" else head_dim
    return ModelConfig(
        architecture="gemma3", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        layer_kinds=gemma3_layer_kinds(layers), sliding_window=window, rope_theta=1e6,
        rope_local_theta=1e4, rope_scaling_factor=scaling, query_pre_attn_scalar=float(scalar),
        max_position_embeddings=32768 if name in ("gemma3-270m", "gemma3-1b") else 131072,
    )
