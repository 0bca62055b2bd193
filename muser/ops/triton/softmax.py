"""The online softmax of the exact attention route, written once for decode and prefill
(docs/exactness.md): a query row's bits do not depend on the width it runs at, its chunking, or
where its keys are held.

- Keys are visited in tiles of KEY_TILE anchored at logical positions (multiples of KEY_TILE
  from position 0), in increasing order; keys a row cannot see are masked to -inf, so a tile
  with none it sees leaves its state exactly as it was.
- Tiles are grouped into spans of SPAN keys, also anchored at logical positions: each span's
  partial (max, sum, weighted values) starts from nothing, and the partials are merged in span
  order, by `merge_weights`. Decode runs a span a program and merges in a second kernel; a
  prefill chunk merges in registers, or (a short chunk at depth) a span a program too. The
  partials and their merges are the same either way.
- Within a tile: scores and weighted values on tensor cores, the row sum of the weights too (a
  dot with ones: a sum along a row by `tl.sum` follows the register layout). A chain of 16-bit
  dots sums alike whatever the tile's row count, warps or instruction (mma.sync or wgmma:
  measured, bench/results/exact_probe_h100.json), so decode programs hold their query heads in
  16 rows and prefill programs a tile's 64 rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

KEY_TILE = 64
SPAN = 256  # keys per partial: a multiple of KEY_TILE
EXACT_ROWS = 64  # query rows of a prefill program (decode: its query heads, at least 16)


def exact_warps(head_dim: int) -> int:
    """Warps of a prefill program: eight from head_dim 256, where its two float32
    accumulators of 64 x head_dim need them."""
    return 8 if head_dim >= 256 else 4


@triton.jit
def fold(q, acc, m, l, k, v, visible, scale_log2, BLOCK: tl.constexpr):
    """A tile of BLOCK keys (k, v) folded into the online softmax (m, l, acc) of the rows of q;
    visible [rows, BLOCK]: which keys each row sees. Float32 keys multiply in float32."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None]).to(v.dtype)
    ones = tl.full((BLOCK, 16), 1.0, v.dtype)
    l = l * alpha + tl.max(tl.dot(p, ones, input_precision="ieee"), axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc, m_new, l


@triton.jit
def merge_weights(m_run, m_part):
    """The running max and a partial's -> (merged max, weight of the running sums, weight of
    the partial's). An empty partial (max -inf) weighs 0 and leaves the running sums exactly."""
    m_new = tl.maximum(m_run, m_part)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp2(m_run - m_use), tl.exp2(m_part - m_use)
