"""GGUF loading (Gemma 3; Gemma 4's config in gguf_gemma4.py): the model config from metadata
and every weight via `gguf`: dequantized, or kept as block codes (CPU) or as the file's
blocks (GPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from muser.config import ModelConfig, gemma3_layer_kinds
from muser.errors import ModelLoadError
from muser.graph.weights import (
    LayerWeights,
    Matrix,
    ModelWeights,
    MoeWeights,
    gemma4_layer_fields,
)
from muser.loading.gguf_gemma4 import config_from_gemma4_gguf
from muser.loading.names import (
    GEMMA4_AS_STORED,
    GEMMA4_LAYER_NAMES,
    GEMMA4_MOE_NAMES,
    GEMMA4_PLE_NAMES,
    GGUF_LM_HEAD,
    GGUF_ROPE_FREQS,
    GLOBAL_NAMES,
    LAYER_NAMES,
    MOE_EXPERTS,
    MOE_GAINS,
    NORMS,
    gemma4_layer_names,
)
from muser.loading.reader import FastGGUFReader, field
from muser.ops.blocks import KERNEL_TYPES, BlockMatrix, cat_blocks
from muser.ops.packed import PackedMatrix, cat_rows, dense
from muser.ops.quants import UnsupportedQuantization, codes, dequantize

SUPPORTED_ARCHITECTURES = ("gemma3", "gemma4")
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # not stored in GGUF; llama.cpp uses the same constant
GEMMA3_SLIDING_PATTERN = 6


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open and validate a GGUF file, or raise ModelLoadError with one line naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        reader = FastGGUFReader(path)
    except Exception as exc:  # noqa: BLE001 (the reader raises many types on corrupt input)
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ModelLoadError(f"{path}: truncated (tensor data ends at byte {end}, file has "
                             f"{path.stat().st_size})")
    return reader


def config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    """Architecture-neutral ModelConfig from GGUF metadata."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture '{arch}' (supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    if arch == "gemma4":
        return config_from_gemma4_gguf(reader)
    num_layers = int(field(reader, f"{arch}.block_count"))
    hidden, num_heads = int(field(reader, f"{arch}.embedding_length")), int(
        field(reader, f"{arch}.attention.head_count"))
    head_dim = int(field(reader, f"{arch}.attention.key_length"))
    pattern = int(field(reader, f"{arch}.attention.sliding_window_pattern",
                        GEMMA3_SLIDING_PATTERN))
    # NOTE: Gemma 3 27B scales queries by (hidden / heads) ** -0.5, the others by head_dim.
    scalar = hidden / num_heads if num_layers == 62 else head_dim
    scaling = field(reader, f"{arch}.rope.scaling.factor", 1.0)
    return ModelConfig(
        architecture=arch,
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv")),
        head_dim=head_dim,
        layer_kinds=gemma3_layer_kinds(num_layers, pattern),
        sliding_window=int(field(reader, f"{arch}.attention.sliding_window")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base")),
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        rope_scaling_factor=float(scaling),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        query_pre_attn_scalar=float(scalar),
        max_position_embeddings=int(field(reader, f"{arch}.context_length")),
    )


def load_weights(
    reader: gguf.GGUFReader, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
    progress: bool = False, pack: bool = False, blocks: bool = False,
) -> ModelWeights:
    """Dequantize every tensor; matrices to `dtype`, norms stay float32. `pack` (CPU, float32)
    keeps each block-quantized matrix as its codes instead (muser.ops.packed): no dense copy.
    `blocks` (GPU) keeps each matrix of a type the block kernels read as the file's bytes
    (muser.ops.blocks; projections in `dtype`); the others are dequantized, and one warning
    says which and why."""
    assert not (pack and blocks), "codes for the CPU, or blocks for the GPU"
    tensors = {t.name: t for t in reader.tensors}
    # NOTE: rope_freqs (Gemma 4) is read by the config, not as a weight
    bar = tqdm(total=len(tensors) - (GGUF_ROPE_FREQS in tensors), desc="loading weights",
               unit="tensor", disable=not progress)
    dequantized: dict[str, list[str]] = {}  # with `blocks`: why -> matrices dequantized

    def find(name: str) -> gguf.ReaderTensor:
        if name not in tensors:
            raise ModelLoadError(f"GGUF file lacks tensor '{name}'")
        return tensors[name]

    def get(name: str, to: torch.dtype, packable: bool = False,
            as_blocks: bool = False) -> torch.Tensor | PackedMatrix | BlockMatrix:
        t = find(name)
        shape = tuple(int(d) for d in reversed(t.shape))
        bar.update()
        return convert(name, _raw(t), t.tensor_type, shape, to, packable, as_blocks)

    def convert(name: str, raw: torch.Tensor, qtype: gguf.GGMLQuantizationType,
                shape: tuple[int, ...], to: torch.dtype, packable: bool,
                as_blocks: bool) -> torch.Tensor | PackedMatrix | BlockMatrix:
        if as_blocks:
            return BlockMatrix.from_raw(raw.to(device), qtype, shape, dtype)
        try:
            c = codes(raw, qtype, shape) if pack and packable else None
            w = dequantize(raw, qtype, shape) if c is None else None
        except UnsupportedQuantization as exc:
            raise ModelLoadError(f"tensor '{name}': {exc}") from None
        return PackedMatrix.from_codes(c, shape) if c else w.to(device=device, dtype=to)

    def keep_blocks(names: list[str]) -> bool:
        """Whether a matrix of these parts stays blocks: every part of a type the block
        kernels read (NOTE: a fused matrix is all blocks or all values)."""
        qtypes = [find(n).tensor_type for n in names]
        keep = blocks and all(q in KERNEL_TYPES for q in qtypes)
        if blocks and not keep:
            other = next(q for q in qtypes if q not in KERNEL_TYPES)
            for name, q in zip(names, qtypes):
                why = (f"fused with a {other.name} part" if q in KERNEL_TYPES
                       else f"no block kernel reads {q.name}")
                dequantized.setdefault(why, []).append(name)
        return keep

    def matrix(names: list[str]) -> Matrix:
        """One matrix, or fused rows (QKV, gate+up)."""
        keep = keep_blocks(names)
        parts = [get(n, dtype, packable=True, as_blocks=keep) for n in names]
        return _cat_rows(parts) if len(parts) > 1 else parts[0]

    def experts(name: str, shape: tuple[int, int]) -> list[Matrix]:
        """An [experts, rows, columns] tensor -> one matrix of `shape` per expert, each its
        own bytes of the file."""
        t, keep = find(name), keep_blocks([name])
        have = tuple(int(d) for d in reversed(t.shape))
        if have != (cfg.num_experts, *shape):
            raise ModelLoadError(f"GGUF tensor '{name}' has shape {have}, the metadata implies "
                                 f"{(cfg.num_experts, *shape)}")
        raw = _raw(t)
        step = raw.numel() // cfg.num_experts
        bar.update()
        return [convert(name, raw[e * step:(e + 1) * step], t.tensor_type, shape, dtype, True,
                        keep) for e in range(cfg.num_experts)]

    def layer(i: int) -> LayerWeights:
        gemma4 = cfg.architecture == "gemma4"
        table = (gemma4_layer_names(GEMMA4_LAYER_NAMES, cfg, i) if gemma4 else
                 {f: [n] if isinstance(n, str) else n for f, n in LAYER_NAMES.items()})
        gains = GEMMA4_AS_STORED if gemma4 else NORMS
        fields: dict[str, object] = {"k_norm": None}  # None: a KV-sharing layer's
        for field_name, names in table.items():
            names = [f"blk.{i}.{n}" for n in names]
            fields[field_name] = (get(names[0], torch.float32) if field_name in gains
                                  else matrix(names))
        if gemma4:
            gemma4_layer_fields(fields, cfg, i, device)
        if cfg.num_experts:
            fields["moe"] = moe(i)
        return LayerWeights(**fields)

    def moe(i: int) -> MoeWeights:
        h, inner = cfg.hidden_size, cfg.moe_intermediate_size
        shapes = {"gate_up": (2 * inner, h), "down": (h, inner)}
        fields: dict[str, object] = {}
        for field_name, name in GEMMA4_MOE_NAMES.items():
            name = f"blk.{i}.{name}"
            fields[field_name] = (get(name, torch.float32) if field_name in MOE_GAINS else
                                  experts(name, shapes[field_name]) if field_name in MOE_EXPERTS
                                  else matrix([name]))
        return MoeWeights(**fields)

    inv = {v: k for k, v in GLOBAL_NAMES.items()}
    weights = ModelWeights(
        embed=matrix([inv["embed"]]),
        final_norm=get(inv["final_norm"], torch.float32),
        layers=[layer(i) for i in range(cfg.num_layers)],
        lm_head=None if cfg.tie_word_embeddings else matrix([GGUF_LM_HEAD]),
    )
    if cfg.per_layer_input_size:
        ple = {v: k for k, v in GEMMA4_PLE_NAMES.items()}
        weights.per_layer_embed = matrix([ple["per_layer_embed"]])
        weights.per_layer_model_proj = matrix([ple["per_layer_model_proj"]])
        weights.per_layer_proj_norm = get(ple["per_layer_proj_norm"], torch.float32)
    bar.close()
    if dequantized:
        logging.getLogger("muser.loading").warning(
            "GGUF matrices dequantized to %s, not kept as blocks (the block kernels read %s): "
            "%s", str(dtype).removeprefix("torch."), ", ".join(q.name for q in KERNEL_TYPES),
            "; ".join(f"{why}: {', '.join(names)}" for why, names in dequantized.items()))
    return weights


def _raw(t: gguf.ReaderTensor) -> torch.Tensor:
    """A tensor's bytes as stored, flat uint8."""
    return torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))


def _cat_rows(parts: list[Matrix]) -> Matrix:
    """Fused rows (QKV, gate+up): blocks or codes when every part has them, else values."""
    if all(isinstance(p, BlockMatrix) for p in parts):
        return cat_blocks(parts)
    if all(isinstance(p, PackedMatrix) for p in parts):
        return cat_rows(parts)
    return torch.cat([dense(p).to(parts[0].dtype) for p in parts])
