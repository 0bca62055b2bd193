"""Kernel tests: each Triton op vs the float64 reference (see opcheck.py)."""

from __future__ import annotations

import pytest
import torch

import opcheck  # noqa: F401  (selects the interpreter before triton is imported)

pytest.importorskip("triton")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(1234)
