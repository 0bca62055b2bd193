"""Warming a weight into L2 while a kernel that reads little from memory runs (Hopper and
later): decode attention at batch 1 is latency-bound (a few MB of K/V rows over ~8 us), so its
programs ask for the next projection's weights (the O projection's, 22 MB on gemma3-27b in FP8),
which that GEMV then reads from L2 instead of HBM. A bulk prefetch (`cp.async.bulk.prefetch.L2`)
is a hint: it writes nothing and changes no result. MUSER_L2_WARM=0 turns it off."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_ENABLED = os.environ.get("MUSER_L2_WARM", "1") != "0"


def enabled(device: torch.device) -> bool:
    """Bulk L2 prefetches compile for this device (sm_90+) and are wanted."""
    if not _ENABLED or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def prefetch(ptr, nbytes):
    """Ask L2 for `nbytes` (a multiple of 16, > 0) from `ptr` (16-byte aligned): one thread of
    the program issues it."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_share(ptr, nbytes, program, programs):
    """Program `program` of `programs` warms its 16-byte-aligned share of `nbytes` at ptr."""
    share = tl.cdiv(tl.cdiv(nbytes, programs), 16) * 16
    lo = program.to(tl.int64) * share
    size = tl.minimum(share, nbytes - lo)
    if size > 0:
        prefetch(ptr + lo, size.to(tl.int32))
