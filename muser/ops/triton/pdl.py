"""Programmatic dependent launch (Hopper and later): a kernel may start while the kernel before
it on the stream is still finishing, so its launch and ramp-up hide behind that kernel's tail.

A kernel launched this way calls `enter(PDL)` before it reads anything an earlier kernel wrote
and before it writes anything at all: that waits until the previous grid has completed (and its
writes are visible), then lets the next kernel launch. By induction a kernel starts only after
every kernel two or more places before it has completed. What a kernel may do before `enter` is
work that depends on nothing this step produced: index arithmetic, and an L2 prefetch
(`prefetch_rows`) of the GEMV's weight rows or of decode attention's cached K/V rows, so a
kernel's memory stream starts while the previous kernel drains.

Captured into a CUDA graph, the launches become programmatic edges. MUSER_PDL=0 turns it off.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ENABLED = os.environ.get("MUSER_PDL", "1") != "0"
_PREFETCH = {"weights", "kv"}
_CAPABLE: dict[int, bool] = {}
_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}


def set_enabled(enabled: bool, prefetch: tuple[str, ...] = ("weights", "kv")) -> None:
    """Turn programmatic dependent launch on or off for later launches and graph captures,
    and choose what is prefetched under it: GEMV "weights", decode attention's "kv" rows."""
    global _ENABLED, _PREFETCH
    _ENABLED, _PREFETCH = enabled, set(prefetch)


def prefetch_enabled(what: str) -> bool:
    return what in _PREFETCH


def enabled(device: torch.device) -> bool:
    if not _ENABLED or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _CAPABLE[index]


def options(device: torch.device) -> dict:
    """The launch keywords of a PDL-aware kernel: its PDL constexpr and Triton's option."""
    return _ON if enabled(device) else _OFF


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_rows(row_ptrs, nbytes):
    """Bulk-prefetch `nbytes` from each row pointer into L2 (16-byte aligned, size a multiple
    of 16). Lines already present or in flight are not fetched twice."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0",
                              "=r,l,r", [row_ptrs, nbytes], dtype=tl.int32, is_pure=False,
                              pack=1)
