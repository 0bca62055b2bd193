"""What the runner's warm-up asks of the Triton backend: stored picks in, every kernel a
forward needs compiled in parallel, measured picks out, and counters that show whether anything
was tuned or compiled after it.

Compiled kernels land in Triton's persistent cache (TRITON_CACHE_DIR, by default
~/.triton/cache), so a later process loads them from disk instead of compiling.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.runtime._async_compile import AsyncCompileMode

from muser.ops.triton import linear, picks
from muser.ops.triton.gemv import MAX_ROWS
from muser.ops.triton.launch import compile_only

EXACT_ROWS = MAX_ROWS  # projections of up to this many rows are keyed by their exact count


@dataclass(slots=True)
class JitStats:
    compiles: int = 0  # kernels the JIT compiled or loaded (its in-process cache missed)


JIT = JitStats()


def _count_compile(*args, **kwargs) -> None:
    """Triton's jit_cache_hook (NOTE: it must return a false value, or Triton skips the
    compile)."""
    JIT.compiles += 1


triton.knobs.runtime.jit_cache_hook = _count_compile


def load(device: torch.device) -> dict[str, int]:
    """Take this machine's stored picks, then the shipped table's -> how many from each."""
    cached, shipped = picks.load(device)
    return {"cache": linear.remember(cached, "cache"),
            "shipped": linear.remember(shipped, "shipped")}


def save(device: torch.device) -> Path | None:
    """Store the picks timed in this process -> the cache file (None: nothing was timed)."""
    measured = linear.measured()
    return picks.save(device, measured) if measured else None


@contextmanager
def compiling(threads: int | None = None) -> Iterator[AsyncCompileMode]:
    """Inside, kernel launches (and shapes without a pick: all their candidates) are compiled
    on a thread pool instead of run; leaving waits for every compile. Outputs computed inside
    are garbage: run the forward again afterwards."""
    workers = threads or min(32, os.cpu_count() or 1)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="muser-compile")
    with pool, AsyncCompileMode(pool, ignore_errors=True) as mode:
        token = compile_only.set(True)
        try:
            yield mode
        finally:
            compile_only.reset(token)


def stats() -> dict[str, int]:
    """Shapes tuned and kernels compiled so far in this process."""
    return {"tuned": linear.STATS.tuned, "compiles": JIT.compiles}
