"""Programmatic dependent launch (Hopper and later): a kernel may start while the kernel before
it on the stream is still finishing, so its launch and ramp-up hide behind that kernel's tail.

A kernel launched this way calls `enter(PDL)` before it writes anything at all and before it
reads anything the kernel just before it may have written: that waits until the previous grid
has completed (and its writes are visible), then lets the next kernel launch. By induction a
kernel starts only after every kernel two or more places before it has completed, so what it
reads of theirs (the step's metadata, cos/sin, K/V rows stored by earlier steps) and the
weights may be loaded before the wait, in flight while the kernel before finishes: the row
GEMV's first weight tiles, the norms' weights, the decode split's metadata and first key tile.
Nothing is prefetched into L2 before the wait: the loads above are what the kernel itself
consumes first, an L2 prefetch only adds traffic (docs/gpu-notes.md has the measurements).

Captured into a CUDA graph, the launches become programmatic edges. switched(pdl=False)
(switches.py) turns it off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from muser.ops.triton.switches import current as switches_in_force

_OPTIONS: dict[torch.device, dict] = {}  # device -> launch keywords with the switch on
_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use it: the switch on (switches.py) and a Hopper or later
    GPU."""
    return switches_in_force().pdl and _supported(device)


def _supported(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (9, 0)


def options(device: torch.device) -> dict:
    """The launch keywords of a PDL-aware kernel: its PDL constexpr and Triton's option."""
    if not switches_in_force().pdl:
        return _OFF
    opts = _OPTIONS.get(device)
    if opts is None:
        opts = _OPTIONS[device] = _ON if _supported(device) else _OFF
    return opts


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
