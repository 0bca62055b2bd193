"""What the runner's warm-up asks of the Triton backend: stored picks in, every kernel a
forward needs compiled and loaded in parallel, measured picks out, and counters that show
whether anything was tuned or compiled after it (each JIT cache miss is named in `misses`).

Compiled kernels land in Triton's persistent cache (TRITON_CACHE_DIR, by default
~/.triton/cache), so a later process loads them from disk instead of compiling. Loading a kernel
(its module onto the device, and its launcher: a C extension Triton builds with the host
compiler when its cache lacks it) is otherwise done by Triton on the kernel's first launch, one
at a time; `compiling` does it on the compile threads.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.runtime._async_compile import AsyncCompileMode
from triton.runtime.errors import OutOfResources

from muser.ops.triton.block_weights import EXACT_PICKS as EXACT_BLOCK_PICKS
from muser.ops.triton.block_weights import PICKS as BLOCK_PICKS
from muser.ops.triton.gemv import MAX_ROWS
from muser.ops.triton.kernel_list import Compiled
from muser.ops.triton.kernel_list import load as load_kernels
from muser.ops.triton.kernel_list import save as save_kernels
from muser.ops.triton.kernel_list import store as kernel_store
from muser.ops.triton.launch import compile_only
from muser.ops.triton.linear import PICKS as LINEAR_PICKS
from muser.ops.triton.linear import choices as linear_choices
from muser.ops.triton.linear_fp8 import PICKS as FP8_PICKS
from muser.ops.triton.picks import load as load_picks
from muser.ops.triton.picks import save as save_picks
from muser.ops.triton.timing import STATS
from muser.ops.tuning_cache import TuningCache

EXACT_ROWS = MAX_ROWS  # projections of up to this many rows are keyed by their exact count


@dataclass(slots=True)
class JitStats:
    compiles: int = 0  # kernels the JIT compiled or loaded (its in-process cache missed)
    misses: list[str] = field(default_factory=list)  # "<kernel> <specialization key>" of each
    compiled: list[Compiled] = field(default_factory=list)  # what each miss was
    serving: bool = False  # set once the warm-up is over: a miss after it is a request stall


JIT = JitStats()
log = logging.getLogger("muser.tuning")


def _count_compile(*, key, fn, compile, **kwargs) -> None:
    """Triton's jit_cache_hook (NOTE: it must return a false value, or Triton skips the
    compile)."""
    JIT.compiles += 1
    JIT.misses.append(f"{fn.name} {key}")
    JIT.compiled.append((fn.jit_function, key, compile["specialization_data"]))
    if JIT.serving:
        log.warning("kernel %s compiled after the warm-up, on the request path (%s)",
                    fn.name, key)


def warming() -> None:
    """A warm-up starts: what it compiles or tunes is no stall, even after another engine of
    this process has served (a benchmark comparing two engines)."""
    JIT.serving = STATS.serving = False


def serving() -> None:
    """The warm-up is over: from now on a compile or a tuned shape is logged as a stall."""
    JIT.serving = STATS.serving = True


triton.knobs.runtime.jit_cache_hook = _count_compile


class Family(NamedTuple):
    """A family's pick table, as the warm-up takes picks in and out of it."""

    remember: Callable[[dict, str], int]  # stored picks in -> how many were taken
    measured: Callable[[], dict]  # picks timed in this process
    choices: Callable[[], dict[str, dict]]  # per shape: the pick it runs (receipts)


FAMILIES = {  # picks.FAMILIES
    "linear": Family(LINEAR_PICKS.remember, LINEAR_PICKS.measured, linear_choices),
    "fp8": Family(FP8_PICKS.remember, FP8_PICKS.measured, FP8_PICKS.choices),
    "blocks": Family(BLOCK_PICKS.remember, BLOCK_PICKS.measured, BLOCK_PICKS.choices),
    "blocks_exact": Family(EXACT_BLOCK_PICKS.remember, EXACT_BLOCK_PICKS.measured,
                           EXACT_BLOCK_PICKS.choices),
}


def load(device: torch.device) -> dict[str, int]:
    """Take this machine's stored picks, then the shipped table's -> how many from each."""
    cached, shipped = load_picks(device)
    return {origin: sum(table.remember(stored[family], origin)
                        for family, table in FAMILIES.items())
            for origin, stored in (("cache", cached), ("shipped", shipped))}


def save(device: torch.device) -> Path | None:
    """Store the picks timed in this process -> the cache file (None: nothing was timed)."""
    measured = {family: table.measured() for family, table in FAMILIES.items()}
    return save_picks(device, measured) if any(measured.values()) else None


@contextmanager
def compiling(device: torch.device, threads: int | None = None) -> Iterator[AsyncCompileMode]:
    """Inside, kernel launches (and shapes without a pick: all their candidates) are compiled
    on a thread pool instead of run; leaving waits for every compile, then loads every compiled
    kernel on the same pool. Outputs computed inside are garbage: run the forward again
    afterwards."""
    with _pool(device, threads) as pool:
        with AsyncCompileMode(pool, ignore_errors=True) as mode:
            token = compile_only.set(True)
            try:
                yield mode
            finally:
                compile_only.reset(token)
        compiled = [f.kernel for f in mode.future_kernels.values() if f.kernel is not None]
        list(pool.map(_load, compiled))


def listed(device: torch.device, config: str) -> TuningCache:
    """The kernel list of this machine, `config` and the picks taken (`kernel_list.py`)."""
    runs = sorted((family, key, choice["runs"]) for family, table in FAMILIES.items()
                  for key, choice in table.choices().items())
    return kernel_store(device, f"{config} {runs}")


def load_listed(kernels: TuningCache, device: torch.device) -> int:
    """File the listed kernels in the JIT's cache and load them on a thread pool -> how many
    (0: no list, or nothing in it is still in Triton's cache)."""
    found = load_kernels(kernels, _index(device))
    with _pool(device, None) as pool:
        list(pool.map(_load, found))
    return len(found)


def save_listed(kernels: TuningCache, device: torch.device, since: int) -> int:
    """List the kernels compiled since JIT.compiled[since] -> how many were added."""
    return save_kernels(kernels, JIT.compiled[since:], _index(device))


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _pool(device: torch.device, threads: int | None) -> ThreadPoolExecutor:
    """Threads on `device` (one per core, at most 32)."""
    return ThreadPoolExecutor(threads or min(32, os.cpu_count() or 1),
                              thread_name_prefix="muser-compile",
                              initializer=torch.cuda.set_device, initargs=(_index(device),))


def _load(kernel) -> None:
    """Load a compiled kernel as its first launch would. One too large for the device keeps
    Triton's error for its launch (a candidate the tuner then skips); after any other failure
    the kernel is left unloaded, for its first launch to load."""
    try:
        kernel.run  # noqa: B018  (the property loads the module and the launcher)
    except OutOfResources:
        pass
    except Exception as exc:  # noqa: BLE001
        kernel.module = kernel.function = kernel._run = None
        warnings.warn(f"{kernel.name}: not loaded ahead ({exc}); its first launch loads it",
                      stacklevel=1)


def stats() -> dict[str, int]:
    """Shapes tuned and kernels compiled so far in this process."""
    return {"tuned": STATS.tuned, "compiles": JIT.compiles}
