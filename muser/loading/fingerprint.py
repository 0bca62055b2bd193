"""A model's fingerprint: what two processes compare before one uses the other's KV.

sha256 over the ModelConfig and the weights' source: for a GGUF file, the CRC32 of the whole
file (its metadata and every tensor's bytes as stored, so the same file fingerprints the same
on any backend and dtype); for dummy weights, the preset and its seed. Printed as its first 16
hex digits.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

from muser.config import ModelConfig

_CHUNK = 16 << 20


def fingerprint(cfg: ModelConfig, path: Path | str) -> str:
    digest = hashlib.sha256(repr(cfg).encode())
    source = str(path)
    if source.startswith("dummy:"):
        digest.update(source.encode())
    else:
        crc = 0
        with open(source, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        digest.update(f"{Path(source).stat().st_size}:{crc:08x}".encode())
    return digest.hexdigest()[:16]
