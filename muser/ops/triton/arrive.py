"""Last-arriver epilogues: the programs of one group each write a partial result, and the last
of them to finish (an atomic counter) combines the partials, in a fixed order, in the same
launch. This removes a reduction kernel (and its launch gap) while staying deterministic, so
graph replay still equals eager bit for bit.

Counters live in one zeroed int32 buffer per device; the last arriver resets its counter, so
the next launch on the stream finds it zero again (also across CUDA graph replays).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COUNTERS = 1 << 14
_BUFFERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's counter buffer (allocated zeroed on first use, outside any graph)."""
    assert needed <= COUNTERS, f"{needed} arrival counters requested, {COUNTERS} exist"
    device = torch.device(device)
    if device not in _BUFFERS:
        _BUFFERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _BUFFERS[device]


@triton.jit
def arrive(counter_ptr, group_size):
    """Call after this program stored its partial: True in the last of `group_size` programs
    sharing `counter_ptr` (whose partials are then all visible to it)."""
    tl.debug_barrier()  # every thread of this program has stored its part of the partial
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = old == group_size - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last
