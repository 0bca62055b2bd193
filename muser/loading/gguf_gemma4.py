"""GGUF files of llama.cpp's `gemma4` architecture -> ModelConfig: the metadata its
convert_hf_to_gguf.py writes, and what the tensors themselves say (K=V: no value projection
on the full layers; PLE's table size; the head tied or not; the full layers' rotated
fraction from rope_freqs).

| config.json | GGUF (`gemma4.` prefix) |
|---|---|
| head_dim, global_head_dim | attention.key_length_swa, attention.key_length |
| num_key_value_heads, num_global_key_value_heads | attention.head_count_kv (one or one per layer) |
| layer_types | attention.sliding_window_pattern (true: sliding) |
| rope_parameters' rope_theta | rope.freq_base_swa, rope.freq_base |
| full layers' partial_rotary_factor | rope_freqs.weight: 1 on the rotated angle pairs, 1e30 on the rest |
| use_double_wide_mlp | feed_forward_length per layer (twice as wide on the KV-sharing ones) |
| num_kv_shared_layers | attention.shared_kv_layers |
| hidden_size_per_layer_input | embedding_length_per_layer_input |
| num_experts, top_k_experts, moe_intermediate_size | expert_count, expert_used_count, expert_feed_forward_length |
"""

from __future__ import annotations

import gguf
import numpy as np

from muser.config import LayerKind, ModelConfig
from muser.errors import ModelLoadError
from muser.loading.names import GEMMA4_PLE_NAMES, GGUF_LM_HEAD, GGUF_ROPE_FREQS
from muser.loading.reader import field

ARCH = "gemma4"
UNROTATED = 1e30  # rope_freqs' divisor of an angle pair that does not turn (angle ~0)


def config_from_gemma4_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    """ModelConfig of a `gemma4` GGUF file."""
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default=None):
        return field(reader, f"{ARCH}.{name}", default)

    num_layers = int(key("block_count"))
    kinds: tuple[LayerKind, ...] = tuple(
        "sliding" if s else "global" for s in _per_layer(key("attention.sliding_window_pattern"),
                                                         num_layers, "sliding_window_pattern"))
    head_dim, global_head_dim = int(key("attention.key_length_swa")), int(
        key("attention.key_length"))
    if (int(key("attention.value_length_swa", head_dim)), int(key("attention.value_length",
                                                                  global_head_dim))) != (
            head_dim, global_head_dim):
        raise ModelLoadError("GGUF metadata: value heads of another size than the keys' are "
                             "not supported")
    if int(key("rope.dimension_count_swa", head_dim)) != head_dim:
        raise ModelLoadError("GGUF metadata: partial RoPE on sliding layers is not supported")
    kv_heads, global_kv_heads = _heads_per_kind(_per_layer(
        key("attention.head_count_kv"), num_layers, "attention.head_count_kv"), kinds)
    shared = int(key("attention.shared_kv_layers", 0))
    intermediate, double_wide = _mlp_widths(
        _per_layer(key("feed_forward_length"), num_layers, "feed_forward_length"), shared)
    ple = int(key("embedding_length_per_layer_input", 0))
    owner = next(i for i in range(num_layers - shared) if kinds[i] == "global")
    experts = int(key("expert_count", 0))
    try:
        return ModelConfig(
            architecture=ARCH, vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
            hidden_size=int(key("embedding_length")), intermediate_size=intermediate,
            num_layers=num_layers, num_heads=int(key("attention.head_count")),
            num_kv_heads=kv_heads, head_dim=head_dim, layer_kinds=kinds,
            sliding_window=int(key("attention.sliding_window")),
            rope_theta=float(key("rope.freq_base")),
            rope_local_theta=float(key("rope.freq_base_swa", 10_000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            query_pre_attn_scalar=1.0,  # Gemma 4 does not scale its scores (QK-norm does)
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings=GGUF_LM_HEAD not in tensors,
            final_logit_softcapping=key("final_logit_softcapping", 0.0) or None,
            global_head_dim=global_head_dim, global_num_kv_heads=global_kv_heads,
            rope_fraction=_rope_fraction(tensors.get(GGUF_ROPE_FREQS), global_head_dim),
            k_eq_v_kinds=(frozenset({"global"}) if f"blk.{owner}.attn_v.weight" not in tensors
                          else frozenset()),
            v_norm=True, per_layer_input_size=ple,
            per_layer_vocab_size=_rows(tensors, next(iter(GEMMA4_PLE_NAMES))) if ple else 0,
            num_kv_shared_layers=shared, double_wide_mlp=double_wide,
            num_experts=experts, top_k_experts=int(key("expert_used_count", 0)),
            moe_intermediate_size=int(key("expert_feed_forward_length", 0)),
        )
    except ValueError as exc:
        raise ModelLoadError(f"GGUF metadata: {exc}") from None


def _per_layer(value, num_layers: int, name: str) -> list:
    """A value given once for every layer or once per layer -> one per layer."""
    values = list(value) if isinstance(value, list) else [value] * num_layers
    if len(values) != num_layers:
        raise ModelLoadError(f"GGUF metadata: {name} names {len(values)} layers, the model has "
                             f"{num_layers}")
    return values


def _heads_per_kind(values: list, kinds: tuple[LayerKind, ...]) -> tuple[int, int]:
    """(sliding, full) layers' KV heads: one value a kind, or an error (muser carries one per
    kind); a model without sliding layers gives the full layers' for both."""
    found: dict[LayerKind, set[int]] = {}
    for value, kind in zip(values, kinds, strict=True):
        found.setdefault(kind, set()).add(int(value))
    if any(len(v) != 1 for v in found.values()):
        raise ModelLoadError("GGUF metadata: head_count_kv differs between layers of one kind")
    heads = {kind: v.pop() for kind, v in found.items()}
    return heads.get("sliding", heads["global"]), heads["global"]


def _mlp_widths(widths: list, shared: int) -> tuple[int, bool]:
    """(intermediate_size, double_wide_mlp) from the per-layer MLP widths: one width, or the
    KV-sharing layers' twice the others'."""
    first = len(widths) - shared
    base = {int(w) for w in widths[:first]}
    tail = {int(w) for w in widths[first:]}
    if len(base) == 1 and tail <= {*base}:
        return base.pop(), False
    if len(base) == 1 and tail == {2 * next(iter(base))}:
        return base.pop(), True
    raise ModelLoadError("GGUF metadata: feed_forward_length per layer is neither one width "
                         "nor the KV-sharing layers' twice the others'")


def _rope_fraction(freqs: gguf.ReaderTensor | None, head_dim: int) -> float:
    """The full layers' rotated share of angle pairs: rope_freqs is 1 on the first n pairs and
    UNROTATED on the rest (convert_hf_to_gguf's proportional RoPE); none: every pair turns."""
    if freqs is None:
        return 1.0
    values = np.array(freqs.data, dtype=np.float32).reshape(-1)
    n = int((values == 1.0).sum())
    if values.size != head_dim // 2 or not (values[:n] == 1.0).all() or not (
            values[n:] >= UNROTATED).all():
        raise ModelLoadError(f"GGUF tensor '{GGUF_ROPE_FREQS}': only proportional RoPE (1 on "
                             f"the rotated pairs, {UNROTATED:g} on the rest) is supported")
    fraction = 2 * n / head_dim
    assert int(fraction * head_dim // 2) == n  # as ops.ref.inv_freq counts the rotated pairs
    return fraction


def _rows(tensors: dict[str, gguf.ReaderTensor], name: str) -> int:
    if name not in tensors:
        raise ModelLoadError(f"GGUF file lacks tensor '{name}'")
    return int(tensors[name].shape[-1])
