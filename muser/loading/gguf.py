"""GGUF loading: the model config from metadata and every weight, dequantized, via `gguf`."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from muser.config import ModelConfig, gemma3_layer_kinds
from muser.errors import ModelLoadError
from muser.graph.weights import LayerWeights, ModelWeights
from muser.loading.names import GLOBAL_NAMES, LAYER_NAMES, NORMS
from muser.loading.quants import UnsupportedQuantization, codes, dequantize
from muser.loading.reader import FastGGUFReader
from muser.ops.packed import PackedMatrix, cat_rows, dense

SUPPORTED_ARCHITECTURES = ("gemma3",)
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # not stored in GGUF; llama.cpp uses the same constant
GEMMA3_SLIDING_PATTERN = 6


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open and validate a GGUF file, or raise ModelLoadError with one line naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        reader = FastGGUFReader(path)
    except Exception as exc:  # the reader raises many types on corrupt input
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ModelLoadError(f"{path}: truncated (tensor data ends at byte {end}, file has "
                             f"{path.stat().st_size})")
    return reader


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks '{key}'")
        return default
    return field.contents()


def config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    """Architecture-neutral ModelConfig from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture '{arch}' (supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    num_layers = int(_field(reader, f"{arch}.block_count"))
    hidden, num_heads = int(_field(reader, f"{arch}.embedding_length")), int(
        _field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length"))
    pattern = int(_field(reader, f"{arch}.attention.sliding_window_pattern",
                         GEMMA3_SLIDING_PATTERN))
    # NOTE: Gemma 3 27B scales queries by (hidden / heads) ** -0.5, the others by head_dim.
    scalar = hidden / num_heads if num_layers == 62 else head_dim
    scaling = _field(reader, f"{arch}.rope.scaling.factor", 1.0)
    return ModelConfig(
        architecture=arch,
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv")),
        head_dim=head_dim,
        layer_kinds=gemma3_layer_kinds(num_layers, pattern),
        sliding_window=int(_field(reader, f"{arch}.attention.sliding_window")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base")),
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        rope_scaling_factor=float(scaling),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        query_pre_attn_scalar=float(scalar),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
    )


def load_weights(
    reader: gguf.GGUFReader, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
    progress: bool = False, pack: bool = False,
) -> ModelWeights:
    """Dequantize every tensor; matrices to `dtype`, norms stay float32. `pack` (CPU, float32)
    keeps each block-quantized matrix as its codes instead (muser.ops.packed): no dense copy."""
    tensors = {t.name: t for t in reader.tensors}
    bar = tqdm(total=len(tensors), desc="loading weights", unit="tensor", disable=not progress)

    def get(name: str, to: torch.dtype, packable: bool = False) -> torch.Tensor | PackedMatrix:
        if name not in tensors:
            raise ModelLoadError(f"GGUF file lacks tensor '{name}'")
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))
        try:
            c = codes(raw, t.tensor_type, shape) if pack and packable else None
            w = dequantize(raw, t.tensor_type, shape) if c is None else None
        except UnsupportedQuantization as exc:
            raise ModelLoadError(f"tensor '{name}': {exc}") from None
        bar.update()
        return PackedMatrix.from_codes(c, shape) if c else w.to(device=device, dtype=to)

    def layer(i: int) -> LayerWeights:
        fields = {}
        for field, names in LAYER_NAMES.items():
            to = torch.float32 if field in NORMS else dtype
            names = [names] if isinstance(names, str) else names
            parts = [get(f"blk.{i}.{n}", to, packable=field not in NORMS) for n in names]
            fields[field] = _cat_rows(parts) if len(parts) > 1 else parts[0]
        return LayerWeights(**fields)

    inv = {v: k for k, v in GLOBAL_NAMES.items()}
    weights = ModelWeights(
        embed=get(inv["embed"], dtype, packable=True),
        final_norm=get(inv["final_norm"], torch.float32),
        layers=[layer(i) for i in range(cfg.num_layers)],
    )
    bar.close()
    return weights


def _cat_rows(parts: list[torch.Tensor | PackedMatrix]) -> torch.Tensor | PackedMatrix:
    """Fused rows (QKV, gate+up): codes when every part has them, else values."""
    if all(isinstance(p, PackedMatrix) for p in parts):
        return cat_rows(parts)
    return torch.cat([dense(p).to(parts[0].dtype) for p in parts])
