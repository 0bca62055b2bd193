"""A model's fingerprint: what two processes compare before one uses the other's KV.

sha256 over the ModelConfig and the weights' source: for a GGUF file, the CRC32 of the whole
file (its metadata and every tensor's bytes as stored, so the same file fingerprints the same
on any backend and dtype); for a Hugging Face checkpoint, of its config and safetensors files;
for dummy weights, the preset and where its values were drawn; and the weights' form where it
changes their values (FP8 quantization at load: "fp8", "fp8+head"; nothing for weights as
stored or dequantized, so those fingerprint as before). Printed as its first 16 hex digits.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

from muser.config import ModelConfig

_CHUNK = 16 << 20


def fingerprint(cfg: ModelConfig, path: Path | str, form: str = "") -> str:
    digest = hashlib.sha256(repr(cfg).encode())
    if form:
        digest.update(f"form:{form}".encode())
    source = str(path)
    if source.startswith("dummy:"):
        digest.update(source.encode())
    else:
        for file in _files(Path(source)):
            digest.update(f"{file.name}:{_crc32(file)}".encode())
    return digest.hexdigest()[:16]


def _files(path: Path) -> list[Path]:
    """The files holding a model: a GGUF file, or a checkpoint directory's (or its
    config.json's directory's) config and safetensors."""
    if path.is_file() and path.name != "config.json":
        return [path]
    folder = path if path.is_dir() else path.parent
    return sorted([folder / "config.json", *folder.glob("*.safetensors")])


def _crc32(file: Path) -> str:
    crc = 0
    with file.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{file.stat().st_size}:{crc:08x}"
