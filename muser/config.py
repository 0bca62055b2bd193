"""Frozen configuration: the model's shape (architecture-neutral) and the engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from muser.env import reference_ops

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
    nope_kinds: frozenset[LayerKind] = frozenset()  # kinds without positional encoding (no RoPE)
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0  # scores are scaled by query_pre_attn_scalar ** -0.5
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    # Gemma 4's parts, per-layer data of the same graph (the defaults: none of them, Gemma 3).
    # The full-attention layers' own geometry (None: head_dim, num_kv_heads, as the sliding's).
    global_head_dim: int | None = None
    global_num_kv_heads: int | None = None
    rope_fraction: float = 1.0  # full layers: the share of angle pairs RoPE turns
    # ("proportional" RoPE: pair i < fraction * head_dim / 2 at theta ** (-2i / head_dim), the
    # rest at angle 0)
    k_eq_v_kinds: frozenset[LayerKind] = frozenset()  # kinds whose values are the raw keys
    v_norm: bool = False  # values RMS-normalized per head, without a gain
    per_layer_input_size: int = 0  # PLE: each layer's input width (0: no per-layer inputs)
    per_layer_vocab_size: int = 0  # PLE: rows of the per-layer embedding table
    num_kv_shared_layers: int = 0  # the last n layers read the K/V of the last earlier layer of
    # their kind (kv_owner) and store none
    double_wide_mlp: bool = False  # the KV-sharing layers' MLPs are 2 * intermediate_size wide
    # mixture of experts (0: none): beside every layer's MLP, top_k_experts of num_experts
    # routed experts per token, each a GeGLU MLP moe_intermediate_size wide
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError("layer_kinds must name one kind per layer")
        for kind in ("sliding", "global"):
            if self.num_heads % self.kv_heads_of(kind):
                raise ValueError(f"num_heads must be a multiple of the {kind} layers' KV heads")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError("num_kv_shared_layers must leave at least one layer its own KV")
        if self.num_experts and not 0 < self.top_k_experts <= self.num_experts:
            raise ValueError(f"top_k_experts must be in 1 .. num_experts ({self.num_experts}), "
                             f"got {self.top_k_experts}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("a mixture of experts needs moe_intermediate_size > 0")
        first = self.num_layers - self.num_kv_shared_layers
        for layer_id in range(first, self.num_layers):
            kind = self.layer_kinds[layer_id]
            if kind not in self.layer_kinds[:first]:
                raise ValueError(f"KV-sharing layer {layer_id} has no earlier {kind} layer to "
                                 f"read")

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

    def head_dim_of(self, kind: LayerKind) -> int:
        return (self.global_head_dim or self.head_dim) if kind == "global" else self.head_dim

    def kv_heads_of(self, kind: LayerKind) -> int:
        return ((self.global_num_kv_heads or self.num_kv_heads) if kind == "global"
                else self.num_kv_heads)

    def kv_row(self, kind: LayerKind) -> tuple[int, int]:
        """(KV heads, head dim) of one cached row of a `kind` layer."""
        return self.kv_heads_of(kind), self.head_dim_of(kind)

    def kv_owner(self, layer_id: int) -> int:
        """The layer whose cache `layer_id` reads: itself, or for one of the last
        num_kv_shared_layers the last layer of its kind before them."""
        first = self.num_layers - self.num_kv_shared_layers
        if layer_id < first:
            return layer_id
        kind = self.layer_kinds[layer_id]
        return max(i for i in range(first) if self.layer_kinds[i] == kind)

    def cache_layers(self, kind: LayerKind) -> list[int]:
        """The `kind` layers that hold a cache (every one but the KV-sharing layers)."""
        return [i for i in self.layers_of(kind) if self.kv_owner(i) == i]

    def last_reader(self, layer_id: int) -> int:
        """The last layer that reads `layer_id`'s cache (itself when none shares it)."""
        return max(i for i in range(self.num_layers) if self.kv_owner(i) == layer_id)

    def intermediate_of(self, layer_id: int) -> int:
        shared = self.kv_owner(layer_id) != layer_id
        return self.intermediate_size * (2 if self.double_wide_mlp and shared else 1)


def gemma3_layer_kinds(num_layers: int, pattern: int = 6) -> tuple[LayerKind, ...]:
    """Gemma 3: every `pattern`-th layer attends globally, the rest slide."""
    return tuple("global" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


def default_dtypes(device: str) -> tuple[str, str]:
    """(weight dtype, KV dtype) when the user names none: bfloat16 on the GPU; float32 on the
    CPU, where torch's 16-bit GEMM/GEMV kernels measured no faster than float32 (docs/cpu.md)
    and bfloat16 loses parity with llama.cpp."""
    return ("bfloat16", "bfloat16") if device != "cpu" else ("float32", "float32")


# Batching defaults per backend (EngineConfig.for_device's fields left out or None). CPU: the
# DESIGN's 64-row cap while decodes run and one 512-row chunk per step. GPU: docs/gpu-notes.md,
# "Serving on the GPU"; its decode_waiting_chunk stays None: the startup measures it
# (muser/startup/waiting_chunk.py) and LLM passes the measured cap forward in a new config.
# A prompt's chunk on the GPU may fill the step's whole budget when nothing decodes (2,048
# rows): four times fewer launches than 512-row chunks, so a lone prompt's prefill is the
# GPU's time, not the host's, and the GEMMs run at the widths they are fastest at
# (docs/gpu-notes.md, "The FP8 kernels"). The cost: a prompt prefilled alone leaves
# prefix-cache checkpoints every 2,048 tokens (kvcache/reuse.py, CHECKPOINT_EVERY).
BATCHING = {
    "cpu": {"max_num_seqs": 8, "max_batched_tokens": 512, "decode_waiting_chunk": 64,
            "prefill_chunk": 512},
    "cuda": {"max_num_seqs": 32, "max_batched_tokens": 2048, "decode_waiting_chunk": None,
             "prefill_chunk": 2048},
}


# GiB of ring checkpoints per backend (EngineConfig.for_device, prefix_cache_gb). One checkpoint
# holds a slot's rings and one page: 17 MB for the 270M in float32, 457 MB for gemma3-27b in
# bfloat16 (52 sliding layers of 1,024 rows).
PREFIX_CACHE_GB = {"cpu": 1.0, "cuda": 8.0}
# Prefix reuse per backend (EngineConfig.for_device, prefix_cache): on the CPU its outputs are
# bitwise a cold prefill's (tests/test_prefix_reuse.py); on the H200 a 27B chat's greedy
# tokens matched cold prefills' in every turn (bench/results/prefix_h200.json).
PREFIX_CACHE = {"cpu": True, "cuda": True}


QUANTIZATIONS = ("none", "fp8")
# the KV cache's dtypes: "fp8" is e4m3 codes with a scale per row and KV head (muser/ops/kv_fp8.py)
KV_DTYPES = ("bfloat16", "float16", "float32", "fp8")
# speculative decoding's proposers (muser/engine/speculation.py): "ngram" is prompt lookup,
# "draft" a small model sharing the target's vocabulary (speculative_model)
SPECULATIVE = ("none", "ngram", "draft")
# draft tokens verified per step at most (--num-speculative-tokens): of K = 2..8, the best or
# within 4 % of the best on each of the CPU's prompt-lookup workloads
# (bench/results/spec_cpu.json)
NUM_SPECULATIVE_TOKENS = 6

# EngineConfig fields that for_device fills and no config leaves None.
_RESOLVED = ("fp8_head", "prefill_chunk", "max_num_seqs", "max_batched_tokens", "prefix_cache",
             "prefix_cache_gb")


def _backend(device: str) -> str:
    """The BATCHING / PREFIX_CACHE key of `device`."""
    return "cpu" if device == "cpu" else "cuda"


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine knobs; CLI flags map 1:1 onto these fields. `EngineConfig.for_device` builds one
    from the fields given, the backend's defaults filling those left out or None (BATCHING,
    PREFIX_CACHE, PREFIX_CACHE_GB; fp8_head from quantization). The constructor takes final
    values: a field without a default must be given, and not as None."""

    device: str
    dtype: str = "bfloat16"  # weights and activations fed to projections; see default_dtypes
    kv_dtype: str = "bfloat16"  # one of KV_DTYPES (--kv-cache-dtype)
    quantization: str = "none"  # "fp8": projections as FP8 weights (GPU, muser/ops/fp8.py)
    fp8_head: bool  # with "fp8": the LM head (the tied embedding) FP8 too
    # (for_device: on with "fp8", off without; True without "fp8": an error)
    prefill_chunk: int  # most rows of one sequence per step
    decode_waiting_chunk: int | None  # most prefill rows per step while any decodes
    # (GPU, None: measured at startup; the CPU needs a value)
    max_num_seqs: int  # sequences in flight (decode batch)
    max_batched_tokens: int  # most rows per step (decode + prefill)
    enforce_eager: bool = False  # GPU: no CUDA graphs for decode
    decode_ahead: bool | None = None  # queue each decode step before the last one's tokens
    # reach the host (muser/engine/ahead.py; None: where decode replays CUDA graphs)
    max_model_len: int = 32768
    page_size: int = 256  # rows per KV page of full-attention layers
    num_pages: int | None = None  # None: from free GPU memory (CPU: max_num_seqs * max_model_len)
    gpu_memory_utilization: float = 0.90  # share of the GPU's memory weights, KV and steps use
    num_threads: int | None = None
    prefix_cache: bool  # reuse the KV of prompt prefixes
    prefix_cache_gb: float  # ring checkpoints' store
    kv_host_gb: float = 0.0  # host tier of the prefix cache: what the device evicts (0: none)
    gguf_weights: str = "blocks"  # GPU: "blocks" keeps GGUF blocks the kernels read as the
    # file's bytes, "dequantize" expands every matrix to `dtype`
    speculative: str = "none"  # "ngram": draft tokens by prompt lookup, "draft": by a draft
    # model (speculative_model); either verified exactly
    speculative_model: str | None = None  # with "draft": a GGUF file, a Hugging Face
    # checkpoint directory, or a name muser.loading.default_model.model_path knows
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS  # most drafts per sequence and step
    # a sequence that fills the context drops the oldest half of its rows after n_keep and
    # goes on, the rest's KV computed again (muser/engine/shift.py); off: it ends ("length")
    context_shift: bool = False

    @classmethod
    def for_device(cls, device: str, **given) -> EngineConfig:
        """The config of `device` with the fields `given`; those left out or None take the
        backend's defaults (BATCHING, PREFIX_CACHE, PREFIX_CACHE_GB), fp8_head follows
        quantization."""
        backend = _backend(device)
        defaults = BATCHING[backend] | {"prefix_cache_gb": PREFIX_CACHE_GB[backend],
                                        "prefix_cache": PREFIX_CACHE[backend],
                                        "fp8_head": given.get("quantization",
                                                              cls.quantization) == "fp8"}
        return cls(device=device, **given | {name: value for name, value in defaults.items()
                                             if given.get(name) is None})

    def __post_init__(self) -> None:
        unresolved = [name for name in _RESOLVED if getattr(self, name) is None]
        if self.decode_waiting_chunk is None and _backend(self.device) == "cpu":
            unresolved.append("decode_waiting_chunk")
        if unresolved:
            raise ValueError(f"EngineConfig needs a value for {', '.join(unresolved)} (None "
                             f"takes the backend's default through EngineConfig.for_device)")
        if self.max_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must hold one "
                             f"decode row of every sequence (max_num_seqs = {self.max_num_seqs})")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got "
                             f"{self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and _backend(self.device) == "cpu" and not reference_ops():
            raise ValueError("an FP8 KV cache runs on the GPU: the CPU's attention kernels read "
                             "float32 and 16-bit caches (--kv-cache-dtype float32, bfloat16 or "
                             "float16 there)")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                             f"{self.quantization!r}")
        if self.fp8_head and self.quantization != "fp8":
            raise ValueError("fp8_head applies to quantization 'fp8' only")
        if self.gguf_weights not in ("blocks", "dequantize"):
            raise ValueError(f"gguf_weights must be 'blocks' or 'dequantize', got "
                             f"{self.gguf_weights!r}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE)}, got "
                             f"{self.speculative!r}")
        if (self.speculative == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative 'draft' needs a speculative_model "
                             "(--speculative-model), and a speculative_model needs "
                             f"speculative 'draft' (got {self.speculative!r})")
        if self.speculative == "draft" and _backend(self.device) != "cpu":
            raise ValueError("speculative 'draft' runs on the CPU for now: the draft's runner "
                             "has no GPU memory sizing or decode graphs yet (--speculative "
                             "ngram runs on the GPU)")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if self.prefix_cache_gb < 0:
            raise ValueError(f"prefix_cache_gb must be >= 0, got {self.prefix_cache_gb}")
        if self.kv_host_gb < 0:
            raise ValueError(f"kv_host_gb must be >= 0, got {self.kv_host_gb}")
        if self.kv_host_gb and not self.prefix_cache:
            raise ValueError("kv_host_gb (--kv-host-gb) holds what the prefix cache evicts, so "
                             "it needs the prefix cache, which is off here")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")

