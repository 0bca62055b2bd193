"""Hugging Face checkpoints: config.json -> ModelConfig, model*.safetensors -> weights, each
tensor read from the memory-mapped file, checked against the config's shapes and moved to the
device one at a time."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from muser.config import LayerKind, ModelConfig, gemma3_layer_kinds
from muser.errors import ModelLoadError
from muser.graph.weights import (
    LayerWeights,
    Matrix,
    ModelWeights,
    MoeWeights,
    gemma4_layer_fields,
)
from muser.loading.fp8_checkpoint import Fp8Layout, read_fp8
from muser.loading.hf_gemma4 import ARCHITECTURES as GEMMA4_ARCHITECTURES
from muser.loading.hf_gemma4 import config_from_gemma4
from muser.loading.names import (
    GEMMA4_AS_STORED,
    HF_GEMMA4_LAYER_NAMES,
    HF_GEMMA4_MOE_NAMES,
    HF_GEMMA4_PLE_NAMES,
    HF_GLOBAL_NAMES,
    HF_LAYER_NAMES,
    HF_LM_HEAD,
    MOE_EXPERTS,
    MOE_GAINS,
    NORMS,
    gemma4_layer_names,
)
from muser.ops.fp8 import FP8, Fp8Matrix, cat_rows, quantize_fp8

SUPPORTED_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
                           *GEMMA4_ARCHITECTURES)
# transformers' Gemma3TextConfig defaults: a config.json (a text_config above all) lists only
# what differs from them.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}
_KINDS: dict[str, LayerKind] = {"sliding_attention": "sliding", "full_attention": "global"}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def checkpoint_dir(path: Path) -> Path:
    """The checkpoint directory of `path` (the directory itself, or the one holding its file)."""
    return path if path.is_dir() else path.parent


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or ModelLoadError naming the file."""
    if not path.is_file():
        raise ModelLoadError(f"Hugging Face checkpoint lacks {path.name}: {path}")
    try:
        value = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return value


def config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """Architecture-neutral ModelConfig from a Gemma 3 or Gemma 4 config.json (text model or
    the text part of the multimodal one, whose other towers are skipped: one log line)."""
    arch = (config.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture '{arch}' (supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    if arch in GEMMA4_ARCHITECTURES:
        towers = [name for name in ("vision", "audio") if config.get(f"{name}_config")]
        if towers:
            logging.getLogger("muser.loading").info(
                "%s: loading the text model; its %s tower%s skipped", arch, " and ".join(towers),
                "s are" if len(towers) > 1 else " is")
        return config_from_gemma4(config.get("text_config", config))
    text = TEXT_DEFAULTS | config.get("text_config", config)
    for key, value in (("hidden_activation", "gelu_pytorch_tanh"),
                       ("attn_logit_softcapping", None), ("use_bidirectional_attention", None)):
        if text.get(key, value) not in (value, False):
            raise ModelLoadError(f"config.json: {key} = {text[key]!r} is not supported")
    theta, local_theta, scaling = _rope(text)
    num_layers = int(text["num_hidden_layers"])
    return ModelConfig(
        architecture="gemma3", vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]), intermediate_size=int(text["intermediate_size"]),
        num_layers=num_layers, num_heads=int(text["num_attention_heads"]),
        num_kv_heads=int(text["num_key_value_heads"]), head_dim=int(text["head_dim"]),
        layer_kinds=_layer_kinds(text, num_layers), sliding_window=int(text["sliding_window"]),
        rope_theta=theta, rope_local_theta=local_theta, rope_scaling_factor=scaling,
        rms_norm_eps=float(text["rms_norm_eps"]),
        query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
        max_position_embeddings=int(text["max_position_embeddings"]),
        tie_word_embeddings=bool(text["tie_word_embeddings"]),
        final_logit_softcapping=text["final_logit_softcapping"],
    )


def _layer_kinds(text: dict[str, Any], num_layers: int) -> tuple[LayerKind, ...]:
    """layer_types (newer configs) or every sliding_window_pattern-th layer global (older)."""
    if text.get("layer_types") is None:
        return gemma3_layer_kinds(num_layers, int(text["sliding_window_pattern"]))
    types = list(text["layer_types"])
    unknown = set(types) - set(_KINDS)
    if unknown or len(types) != num_layers:
        raise ModelLoadError(f"config.json: layer_types must name {num_layers} layers of "
                             f"{' or '.join(_KINDS)}, got {len(types)} ({sorted(unknown)})")
    return tuple(_KINDS[t] for t in types)


def _rope(text: dict[str, Any]) -> tuple[float, float, float]:
    """(global theta, local theta, global linear scaling) from rope_parameters (newer configs)
    or rope_theta / rope_local_base_freq / rope_scaling (older)."""
    params = text.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        theta = full.get("rope_theta", TEXT_DEFAULTS["rope_theta"])
        local_theta = local.get("rope_theta", TEXT_DEFAULTS["rope_local_base_freq"])
    else:
        full, local = text.get("rope_scaling") or {}, {}
        theta, local_theta = text["rope_theta"], text["rope_local_base_freq"]
    for name, p, allowed in (("full", full, ("default", "linear")),
                             ("sliding", local, ("default",))):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in allowed:
            raise ModelLoadError(f"config.json: rope type '{kind}' on {name} layers is not "
                                 f"supported (supported: {', '.join(allowed)})")
    linear = full.get("rope_type", full.get("type")) == "linear"
    return float(theta), float(local_theta), float(full["factor"]) if linear else 1.0


class Shards:
    """The safetensors files of a checkpoint directory, opened once each (memory-mapped), and
    which file holds each tensor."""

    def __init__(self, directory: Path) -> None:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index}: no weight_map")
            files = sorted(set(weight_map.values()))
        elif (directory / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in "
                                 f"{directory}")
        self.files = {name: _open(directory / name) for name in files}
        # NOTE: safe_open has keys() and no __iter__
        self.where = {t: f for f, h in self.files.items() for t in h.keys()}  # noqa: SIM118

    def prefix(self) -> str:
        """The text model's name prefix: whatever precedes 'embed_tokens.weight'."""
        key = "embed_tokens.weight"
        found = [n[: -len(key)] for n in self.where if n.endswith(key)]
        if len(found) != 1:
            raise ModelLoadError(f"checkpoint holds {len(found)} tensors named *{key}, "
                                 f"expected one")
        return found[0]

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...], fp8: bool = False) -> torch.Tensor:
        """Tensor `name` from its file (CPU), after checking its shape and dtype (`fp8`: an
        FP8 checkpoint's float8_e4m3fn weights are allowed too)."""
        if name not in self.where:
            raise ModelLoadError(f"checkpoint lacks tensor '{name}'")
        handle = self.files[self.where[name]]
        have = tuple(handle.get_slice(name).get_shape())
        if have != shape:
            raise ModelLoadError(f"tensor '{name}' has shape {have}, config.json implies {shape}")
        t = handle.get_tensor(name)
        if t.dtype not in _DTYPES and not (fp8 and t.dtype == FP8):
            raise ModelLoadError(f"tensor '{name}' is {t.dtype}; muser reads bfloat16, "
                                 f"float16 and float32 safetensors"
                                 f"{', and float8_e4m3fn with their scales' if fp8 else ''}")
        return t

    def scale_of(self, name: str) -> torch.Tensor | None:
        """The weight_scale tensor of FP8 weight `name` (CPU), None when the file lacks it."""
        scale = name.removesuffix("weight") + "weight_scale"
        return self.files[self.where[scale]].get_tensor(scale) if self.has(scale) else None


def _open(path: Path):
    if not path.is_file():
        raise ModelLoadError(f"checkpoint file not found: {path}")
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as exc:  # covers truncated files: the header must span the data
        raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from None


def _shapes(cfg: ModelConfig, layer_id: int) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor of layer `layer_id` (name after 'layers.{i}.')."""
    kv_heads, d = cfg.kv_row(cfg.layer_kinds[layer_id])
    h, i, p = cfg.hidden_size, cfg.intermediate_of(layer_id), cfg.per_layer_input_size
    q, kv = cfg.num_heads * d, kv_heads * d
    return {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "per_layer_input_gate.weight": (p, h), "per_layer_projection.weight": (h, p),
        "post_per_layer_input_norm.weight": (h,), "layer_scalar": (1,),
    } | _moe_shapes(cfg)


def _moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor of a mixture-of-experts layer (none without experts)."""
    if not cfg.num_experts:
        return {}
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"router": (e, h), "router_scale": (h,), "expert_scale": (e,),
              "gate_up": (e, 2 * i, h), "down": (e, h, i)}
    return {name: shapes.get(field, (h,)) for field, name in HF_GEMMA4_MOE_NAMES.items()}


def _layer_names(cfg: ModelConfig, layer_id: int) -> dict[str, list[str]]:
    """LayerWeights field -> the HF tensors (names after 'layers.{i}.') it is read from, rows
    concatenated in order (Gemma 4: names.gemma4_layer_names)."""
    if cfg.architecture != "gemma4":
        return {f: [n] if isinstance(n, str) else n for f, n in HF_LAYER_NAMES.items()}
    return gemma4_layer_names(HF_GEMMA4_LAYER_NAMES, cfg, layer_id)


def load_weights_hf(
    shards: Shards, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
    progress: bool = False, fp8: bool = False, layout: Fp8Layout | None = None,
) -> ModelWeights:
    """Every weight on `device`: matrices in `dtype`, norms float32 with Gemma's 1 + w folded
    in (HF stores w; the graph multiplies by 1 + w, as transformers does in float32).
    `layout`: the checkpoint's FP8 layout (fp8_checkpoint.fp8_layout; None: not quantized),
    whose float8 weights load with their scales. `fp8` (--quantization fp8): the projections
    as Fp8Matrix, taken as stored or quantized one by one on `device`; without it, FP8 weights
    are dequantized to `dtype`. The embedding (the tied head), the experts' router and the norms
    stay unquantized."""
    prefix, gemma4 = shards.prefix(), cfg.architecture == "gemma4"
    names = [_layer_names(cfg, i) for i in range(cfg.num_layers)]
    ple = {v: k for k, v in HF_GEMMA4_PLE_NAMES.items()} if cfg.per_layer_input_size else {}
    moe = len(HF_GEMMA4_MOE_NAMES) if cfg.num_experts else 0
    total = (sum(len(n) for layer in names for n in layer.values()) + 2 + len(ple)
             + (not cfg.tie_word_embeddings) + moe * cfg.num_layers)
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress)

    def norm(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A gain in float32: Gemma 3's 1 + w, Gemma 4's w as stored."""
        t = shards.get(name, shape)
        bar.update()
        return (t.float() if gemma4 else 1.0 + t.float()).to(device)

    def matrix(name: str, shape: tuple[int, ...], quantize: bool) -> Matrix:
        t = shards.get(name, shape, fp8=layout is not None)
        bar.update()
        if t.dtype == FP8:
            t = read_fp8(t, shards.scale_of(name), name, layout, dtype, device)
            if isinstance(t, Fp8Matrix):
                return t if quantize else t.dequantize(dtype)
            return quantize_fp8(t, dtype) if quantize else t.to(dtype)  # per-block float32
        t = t.to(device=device, dtype=dtype)
        return quantize_fp8(t) if quantize else t

    def layer(i: int) -> LayerWeights:
        fields: dict[str, object] = {"k_norm": None}  # None: a KV-sharing layer's
        shapes, gains = _shapes(cfg, i), GEMMA4_AS_STORED if gemma4 else NORMS
        for field, layer_names in names[i].items():
            parts = [norm(f"{prefix}layers.{i}.{n}", shapes[n]) if field in gains
                     else matrix(f"{prefix}layers.{i}.{n}", shapes[n], fp8) for n in layer_names]
            fields[field] = parts[0] if len(parts) == 1 else (
                cat_rows(parts) if isinstance(parts[0], Fp8Matrix) else torch.cat(parts))
        if gemma4:
            gemma4_layer_fields(fields, cfg, i, device)
        if cfg.num_experts:
            fields["moe"] = experts(i)
        return LayerWeights(**fields)

    def experts(i: int) -> MoeWeights:
        """Layer i's routed experts: gate_up and down one matrix per expert."""
        shapes, fields = _shapes(cfg, i), {}
        for field, name in HF_GEMMA4_MOE_NAMES.items():
            full = f"{prefix}layers.{i}.{name}"
            if field in MOE_GAINS:
                fields[field] = norm(full, shapes[name])
            elif field in MOE_EXPERTS:
                stacked = shards.get(full, shapes[name])
                bar.update()
                mats = [t.to(device=device, dtype=dtype) for t in stacked.unbind()]
                fields[field] = [quantize_fp8(t) for t in mats] if fp8 else mats
            else:  # NOTE: the router stays unquantized: its scores choose the experts
                fields[field] = matrix(full, shapes[name], quantize=False)
        return MoeWeights(**fields)

    inv = {v: k for k, v in HF_GLOBAL_NAMES.items()}
    vocab, hidden = (cfg.vocab_size, cfg.hidden_size), (cfg.hidden_size,)
    weights = ModelWeights(
        embed=matrix(prefix + inv["embed"], vocab, quantize=False),
        final_norm=norm(prefix + inv["final_norm"], hidden),
        layers=[layer(i) for i in range(cfg.num_layers)],
        lm_head=None if cfg.tie_word_embeddings else matrix(HF_LM_HEAD, vocab, quantize=False),
    )
    if ple:
        width = cfg.num_layers * cfg.per_layer_input_size
        weights.per_layer_embed = matrix(prefix + ple["per_layer_embed"],
                                         (cfg.per_layer_vocab_size, width), quantize=False)
        weights.per_layer_model_proj = matrix(prefix + ple["per_layer_model_proj"],
                                              (width, cfg.hidden_size), quantize=False)
        weights.per_layer_proj_norm = norm(prefix + ple["per_layer_proj_norm"],
                                           (cfg.per_layer_input_size,))
    bar.close()
    return weights
