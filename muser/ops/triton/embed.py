"""The embedding lookup, scaled, in one launch: h[r] = table[id_r] * scale in float32 (Gemma's
embedding times sqrt(hidden)), where id_r = ids[r], or feed[r] where ids[r] < 0 (a decode step
queued before the host knows its tokens reads them from the device: graphs.py).

A bfloat16 / float16 / float32 table is widened to float32 and multiplied by `scale`; an FP8
table (a tied FP8 head) is its codes widened times the row's scale, then times `scale`: the
reference's two roundings in its order (ref.embed, Fp8Matrix.dequantize). In torch that is a
compare, a where, one or two gathers, a widening copy and one or two multiplies, each its own
launch; a decode step of gemma3-27b FP8 runs this once. GGUF block tables gather their rows as
blocks and dequantize them (block_weights.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.fp8 import Fp8Matrix
from muser.ops.triton.alloc import empty
from muser.ops.triton.launch import cdiv, launch
from muser.ops.triton.pdl import enter, options

BLOCK_D = 1024  # columns a program


@triton.jit
def _embed_kernel(ids_ptr, feed_ptr, table_ptr, scales_ptr, out_ptr, D, scale,
                  FEED: tl.constexpr, FP8: tl.constexpr, BLOCK_D: tl.constexpr,
                  PDL: tl.constexpr):
    enter(PDL)  # NOTE: the ids (and the feed) may be the kernels' just before
    r = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.load(ids_ptr + r).to(tl.int64)
    if FEED:
        i = tl.where(i < 0, tl.load(feed_ptr + r).to(tl.int64), i)
    row = tl.load(table_ptr + i * D + d, mask=d < D, other=0.0).to(tl.float32)
    if FP8:
        row = row * tl.load(scales_ptr + i)
    tl.store(out_ptr + r * D + d, row * scale, mask=d < D)


def embed_rows(table: torch.Tensor | Fp8Matrix, ids: torch.Tensor, scale: float = 1.0,
               feed: torch.Tensor | None = None) -> torch.Tensor:
    """table: [V, D] float (or Fp8Matrix); ids: [N] int (negative: take feed's) -> [N, D]
    float32, ref.embed's values times `scale` (ref.embed(table, where(ids < 0, feed, ids),
    scale))."""
    fp8 = isinstance(table, Fp8Matrix)
    data, scales = (table.data, table.scales) if fp8 else (table, table)
    n, d = ids.shape[0], data.shape[1]
    assert data.is_contiguous() and ids.stride(0) == 1 and (feed is None or feed.stride(0) == 1)
    assert feed is None or feed.shape[0] >= n
    out = empty((n, d), torch.float32, ids.device)
    if n:
        launch(_embed_kernel, (n, cdiv(d, BLOCK_D)), ids, ids if feed is None else feed, data,
               scales, out, d, float(scale), FEED=feed is not None, FP8=fp8,
               BLOCK_D=BLOCK_D, **options(ids.device))
    return out
