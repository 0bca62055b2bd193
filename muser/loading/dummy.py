"""`--load-format dummy`: a named Gemma 3 or Gemma 4 shape (muser/presets.py) with seeded random weights
created on the device, so benchmarks need no checkpoint. The tokenizer is the embedded Gemma 3
model's (same 262k vocabulary), so text still round-trips."""

from __future__ import annotations

from pathlib import Path

import torch

from muser.graph.weights import random_weights
from muser.loading import LoadedModel
from muser.loading.default_model import default_model_path
from muser.loading.gguf import open_gguf
from muser.presets import preset
from muser.tokenizer import Tokenizer


def load_dummy(name: str, dtype: torch.dtype, device: torch.device | str,
               progress: bool = True, seed: int = 0,
               made_on: torch.device | str | None = None, fp8: bool = False) -> LoadedModel:
    """ModelConfig of preset `name`, random weights of `dtype` on `device`, drawn on `made_on`
    (default: `device`); `fp8`: the projections quantized to FP8 (random_weights). The path
    names the shape, where its values were drawn (what a model fingerprint compares: a CPU and
    a GPU draw different values from one seed) and +fp8 when quantized."""
    cfg = preset(name)
    tokenizer = Tokenizer.from_gguf(open_gguf(default_model_path(progress)))
    made_on = torch.device(made_on or device)
    return LoadedModel(Path(f"dummy:{name}@{made_on.type}{'+fp8' if fp8 else ''}"), cfg,
                       tokenizer, random_weights(cfg, dtype, device, seed, made_on, fp8))
