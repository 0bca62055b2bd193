"""GGUF loading: config from metadata, and one clear error for each kind of bad file."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch

from muser.errors import ModelLoadError
from muser.loading import load_model
from muser.loading.gguf import config_from_gguf, open_gguf


def test_config_from_metadata(gguf_reader) -> None:
    cfg = config_from_gguf(gguf_reader)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (18, 640, 2048)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.sliding_window == 512
    assert cfg.layers_of("global") == [5, 11, 17]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.query_pre_attn_scalar == 256 and cfg.rms_norm_eps == pytest.approx(1e-6)


def _patched(src: Path, dst: Path, old: bytes, new: bytes, after: bytes = b"") -> Path:
    """Copy `src` to `dst`, replacing the first `old` that follows `after`."""
    shutil.copyfile(src, dst)
    with dst.open("r+b") as f:
        head = f.read(8 << 20)
        at = head.index(old, head.index(after) if after else 0)
        f.seek(at)
        f.write(new)
    return dst


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        open_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        open_gguf(bad)


def test_truncated_file(gguf_path: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with gguf_path.open("rb") as f, cut.open("wb") as out:
        out.write(f.read(gguf_path.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match="truncated|not a readable"):
        open_gguf(cut)


def test_unsupported_architecture(gguf_path: Path, tmp_path: Path) -> None:
    path = _patched(gguf_path, tmp_path / "arch.gguf", b"gemma3", b"mamba9",
                    after=b"general.architecture")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba9'"):
        load_model(path, torch.float32, "cpu", progress=False)


def test_unsupported_quantization(gguf_path: Path, tmp_path: Path) -> None:
    # NOTE: token_embd is Q8_0 (type 8); its tensor-info record ends with the type id and the
    # data offset. Marking it Q4_1 (3), a smaller block type, leaves every offset valid.
    name = b"token_embd.weight"
    with gguf_path.open("rb") as f:
        head = f.read(8 << 20)
    at = head.index(name) + len(name)
    n_dims = struct.unpack_from("<I", head, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", head, type_at)[0] == 8
    path = _patched(gguf_path, tmp_path / "quant.gguf", head[type_at:type_at + 4],
                    struct.pack("<I", 3), after=name)
    with pytest.raises(ModelLoadError, match="token_embd.weight.*Q4_1"):
        load_model(path, torch.float32, "cpu", progress=False)
