"""Model loading: a path (or the embedded default) -> config, tokenizer and weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from muser.config import ModelConfig
from muser.graph.weights import ModelWeights
from muser.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    weights: ModelWeights


def load_model(
    path: str | Path | None, dtype: torch.dtype, device: torch.device | str,
    progress: bool = True, pack: bool = False,
) -> LoadedModel:
    """Load a GGUF file (None: the embedded default model) onto `device`; `pack` keeps the
    block codes of quantized matrices for the CPU kernels (muser.ops.packed)."""
    from muser.errors import ModelLoadError
    from muser.loading.default_model import default_model_path
    from muser.loading.gguf import config_from_gguf, load_weights, open_gguf

    path = Path(path) if path is not None else default_model_path(progress)
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    weights = load_weights(reader, config, dtype, device, progress, pack)
    return LoadedModel(path, config, tokenizer, weights)
