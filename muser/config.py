"""Frozen configuration: the model's shape (architecture-neutral) and the engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LayerKind = Literal["sliding", "global"]


@dataclass(frozen=True)
class ModelConfig:
    """Everything the layer graph needs to know about a model, in HF vocabulary."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[LayerKind, ...]
    sliding_window: int
    rope_theta: float  # full-attention layers
    rope_local_theta: float  # sliding layers
    rope_scaling_factor: float = 1.0  # linear scaling on full-attention layers
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0  # scores are scaled by query_pre_attn_scalar ** -0.5
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError("layer_kinds must name one kind per layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    def layers_of(self, kind: LayerKind) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == kind]


def gemma3_layer_kinds(num_layers: int, pattern: int = 6) -> tuple[LayerKind, ...]:
    """Gemma 3: every `pattern`-th layer attends globally, the rest slide."""
    return tuple("global" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


def default_dtypes(device: str) -> tuple[str, str]:
    """(weight dtype, KV dtype) when the user names none: bfloat16 on the GPU; float32 on the
    CPU, where torch's 16-bit GEMM/GEMV kernels measured no faster than float32 (README, "CPU
    speed") and bfloat16 loses parity with llama.cpp."""
    return ("bfloat16", "bfloat16") if device != "cpu" else ("float32", "float32")


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs; CLI flags map 1:1 onto these fields."""

    device: str = "cpu"
    dtype: str = "bfloat16"  # weights and activations fed to projections; see default_dtypes
    kv_dtype: str = "bfloat16"
    prefill_chunk: int = 512  # rows per prefill chunk
    decode_waiting_chunk: int = 64  # chunk width while a decode waits
    max_num_seqs: int = 8
    enforce_eager: bool = False  # GPU: no CUDA graphs for decode
    max_model_len: int = 32768
    page_size: int = 256  # rows per KV page of full-attention layers
    num_pages: int | None = None  # None: from free GPU memory (CPU: max_num_seqs * max_model_len)
    gpu_memory_utilization: float = 0.90  # share of the GPU's memory weights, KV and steps use
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
