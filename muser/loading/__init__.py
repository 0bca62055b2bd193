"""Model loading: a path (or the embedded default) -> config, tokenizer and weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from muser.config import ModelConfig
from muser.errors import ModelLoadError
from muser.graph.weights import ModelWeights
from muser.loading.default_model import default_model_path
from muser.loading.fp8_checkpoint import fp8_layout
from muser.loading.gguf import config_from_gguf, load_weights, open_gguf
from muser.loading.gguf_tokenizer import tokenizer_from_gguf
from muser.loading.hf import Shards, checkpoint_dir, config_from_hf, load_weights_hf, read_json
from muser.loading.hf_tokenizer import tokenizer_from_hf
from muser.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    weights: ModelWeights


def load_model(
    path: str | Path | None, dtype: torch.dtype, device: torch.device | str,
    progress: bool = True, pack: bool = False, fp8: bool = False, blocks: bool = False,
) -> LoadedModel:
    """Load a GGUF file or a Hugging Face checkpoint (its directory or its config.json; None:
    the embedded default model) onto `device`; `pack` keeps the block codes of quantized
    GGUF matrices for the CPU kernels (muser.ops.packed), `blocks` the file's blocks of the
    types the GPU's block kernels read (muser.ops.blocks); `fp8` (Hugging Face checkpoints)
    loads the projections as FP8 (muser.ops.fp8)."""
    path = Path(path) if path is not None else default_model_path(progress)
    if is_hf_checkpoint(path):
        return _load_hf(path, dtype, device, progress, fp8)
    if fp8:
        raise ModelLoadError(f"{path}: --quantization fp8 loads Hugging Face checkpoints and "
                             f"dummy weights, not GGUF files")
    return _load_gguf(path, dtype, device, progress, pack, blocks)


def is_hf_checkpoint(path: Path) -> bool:
    """Whether `path` is a Hugging Face checkpoint: a directory, or a JSON file (its
    config.json), told apart from a GGUF file by its content."""
    if path.is_dir():
        return True
    try:
        with path.open("rb") as f:
            return f.read(64).lstrip().startswith(b"{")
    except OSError:
        return False


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device | str, progress: bool,
               pack: bool, blocks: bool) -> LoadedModel:
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    try:
        tokenizer = tokenizer_from_gguf(reader)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    weights = load_weights(reader, config, dtype, device, progress, pack, blocks)
    return LoadedModel(path, config, tokenizer, weights)


def _load_hf(path: Path, dtype: torch.dtype, device: torch.device | str,
             progress: bool, fp8: bool) -> LoadedModel:
    directory = checkpoint_dir(path)
    raw = read_json(path if path.is_file() else directory / "config.json")
    config, layout = config_from_hf(raw), fp8_layout(raw)
    tokenizer = tokenizer_from_hf(directory, config.vocab_size)
    weights = load_weights_hf(Shards(directory), config, dtype, device, progress, fp8, layout)
    return LoadedModel(directory, config, tokenizer, weights)
