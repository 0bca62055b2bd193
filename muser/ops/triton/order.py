"""The reduction order of a dense projection on the exact route: one order per output element,
whatever the number of rows (docs/exactness.md).

y[n, j] = sum over k of x[n, k] * W[j, k] is summed as follows, at every width:
- K is cut at fixed offsets, every `k_per_split(M, K)` columns (a multiple of SPLIT_ALIGN);
- each cut's sum is one chain of tensor-core dots over its columns in order, from zero (the
  hardware sums 16 products a step into the float32 accumulator; a chain is the same steps
  whatever the tile's other sizes);
- the cuts' float32 sums are added in cut order, from zero.

Decode rows (gemv.py's `dot` kind) run a cut a program and the last program to finish adds the
cuts; prefill chunks (gemm.py with cuts) add them in registers. Either way the same additions
of the same values, so a row's bits are those of the same row at any other width. The cut is a
property of the weight's shape alone: tuning chooses tiles, stages and warps, never the cut.
"""

from __future__ import annotations

import functools

from muser.ops.triton.launch import cdiv

SPLIT_ALIGN = 256  # columns: every K step of the exact configs (64, 128, 256) divides it
TARGET_PROGRAMS = 160  # decode programs (64-row blocks x cuts) enough to keep an H200's HBM busy


@functools.cache  # NOTE: asked on every projection of an eager (prefill) forward
def k_per_split(m: int, k: int) -> int:
    """Columns per cut of a [m, k] weight: as many cuts (a power of two) as keep a one-row
    GEMV's programs, 64 weight rows a block, within TARGET_PROGRAMS, each cut at least
    SPLIT_ALIGN columns, rounded up to SPLIT_ALIGN."""
    blocks, cuts = cdiv(m, 64), 1
    while blocks * cuts * 2 <= TARGET_PROGRAMS and k // (cuts * 2) >= SPLIT_ALIGN:
        cuts *= 2
    return cdiv(cdiv(k, cuts), SPLIT_ALIGN) * SPLIT_ALIGN
