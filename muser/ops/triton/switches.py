"""The Triton backend's switches for experiments and checks: what a benchmark or a test turns
off (or on) to compare or to check, passed explicitly with `switched(...)`, never read from the
environment. Serving runs the defaults.

    pdl ..... programmatic dependent launch on Hopper and later (pdl.py)
    direct .. launches through launch.py's cache; off: Triton's JIT entry point on every call
    gemv .... projections of plain tensors through the Triton GEMV/GEMM picks (linear.py);
              off: every one on cuBLAS (a way to switch the shape-specific route off)
    poison .. every launcher's output filled with NaN first (alloc.py), so an element a kernel
              fails to write cannot pass as a plausible value
    exact ... one reduction order per output at every width (docs/exactness.md); off: the
              fastest pick per width and cuBLAS among them, for A/B comparisons only
    exact_blocks  GGUF block weights on the exact route too (block_weights.py: their tiles
              dequantized in registers into the dense route's dot chains); off (the default
              until a GPU run has shown it bitwise and timed its decode): decode rows keep
              the int8 block GEMV, whose sums follow the width
    exact_fp8  FP8 weights on the exact route too (their codes as bf16 values, W8A16); off
              (the default until a GPU run has shown its rows bitwise at every width): FP8
              weights keep their FP8 tensor-core route, whose sums follow the width

The switches in force live in a context variable: `switched` sets them for the code inside it
(and for CUDA graphs captured there), then restores what was in force before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Switches:
    pdl: bool = True
    direct: bool = True
    gemv: bool = True
    poison: bool = False
    exact: bool = True
    exact_fp8: bool = False
    exact_blocks: bool = False


_CURRENT: ContextVar[Switches] = ContextVar(
    "muser_triton_switches", default=Switches())  # noqa: B039  (frozen)


def current() -> Switches:
    """The switches in force."""
    return _CURRENT.get()


@contextmanager
def switched(**changes: bool) -> Iterator[Switches]:
    """Inside: the switches in force with `changes` (Switches' field names) applied."""
    token = _CURRENT.set(dataclasses.replace(_CURRENT.get(), **changes))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
