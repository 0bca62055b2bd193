"""Kernel tests: each Triton op vs the float64 reference (see opcheck.py).

Without triton installed (a CPU-only install) these tests are not collected at all.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import opcheck  # noqa: F401  (selects the interpreter before triton is imported)


@pytest.fixture(autouse=True)
def poisoned() -> Iterator[None]:
    """Every kernel output filled with NaN before the kernel runs (muser/ops/triton/switches.py),
    so an element a kernel fails to write cannot pass as a plausible value."""
    from muser.ops.triton import switches

    with switches.switched(poison=True):
        yield


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(1234)
