"""Prefill flash attention (causal, optionally windowed) driven by the chunk's tile classifier.

Grid (query tile, head, key split). Each program walks the key tiles its classifier row marks
non-empty (`tile_ranges`: [first, last + 1) per query tile and the run of FULL tiles inside it,
computed once per chunk and kind), so empty tiles are never read. The FULL run has a loop of
its own with no mask, classifier read or empty-row guard (a chunk at depth is almost all FULL
tiles); the PARTIAL tiles on either side apply the position mask. Online softmax in float32
with exp2; QK^T and PV on tensor cores in the cache dtype.

Keys and values are read either from contiguous rows or, given `read_rows`, from the layer's
store itself: key i is store row read_rows[i] (a prefill chunk at depth attends the paged cache
in place; no gather of the whole prefix per chunk and layer). The rows of each key tile must be
consecutive in the store (pages of a multiple of the tile's rows, a contiguous ring range): the
kernel reads one row number per tile, so its loads stay affine and pipelined.

A chunk at depth has few query tiles and many key tiles: `launch_config` splits each query
tile's key range over several programs (flash-decoding's split-KV applied to a chunk) so the
grid fills the GPU; the splits' partial (max, sum, weighted values) are combined by a second
kernel, in a fixed order.

That is the route with the `exact` switch off. The exact route, the default, runs
`_flash_exact_kernel` instead: key tiles and spans anchored at logical positions, spans merged in
order (softmax.py), the same arithmetic as decode's `_decode_span_kernel` for every row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from muser.errors import MuserError
from muser.ops.kv_fp8 import head_dim_of, is_fp8, packed
from muser.ops.ref import prefill_attention as reference_attention
from muser.ops.routes import Route
from muser.ops.tiles import EMPTY, FULL, classify_tiles
from muser.ops.triton.alloc import empty
from muser.ops.triton.kv_fp8 import dot_code, load_heads, to_dot
from muser.ops.triton.launch import cdiv, launch
from muser.ops.triton.softmax import EXACT_ROWS, KEY_TILE, SPAN, exact_warps, fold, merge_weights
from muser.ops.triton.switches import current as switches_in_force


@triton.jit
def _query_tile(q_ptr, qt, group, T, stride_qt, stride_qh, G: tl.constexpr,
                D: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr, DOT: tl.constexpr):
    """Query tile qt of head group `group`: PACK query heads of one key/value head share the
    program, its PACK * BLOCK rows (head, query row) pairs over the same query rows, so each
    key tile is loaded once for them -> (q in the dot dtype DOT (kv_fp8.py: the cache's, or an
    FP8 cache's model dtype), head, key/value head, query row, row mask, head dims)."""
    r = tl.arange(0, PACK * BLOCK)
    h = group * PACK + r // BLOCK
    kvh = group * PACK // G
    rq = qt * BLOCK + r % BLOCK
    d = tl.arange(0, D)
    q_mask = rq < T
    q = to_dot(tl.load(q_ptr + rq[:, None].to(tl.int64) * stride_qt + h[:, None] * stride_qh
                       + d[None, :], mask=q_mask[:, None], other=0.0), DOT)
    return q, h, kvh, rq, q_mask, d


@triton.jit
def _tile_spans(qt, T, q_start, k_first, shift, S, window, BLOCK: tl.constexpr,
                SPAN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The exact route's key range of query tile qt: its key tiles [lo, hi) (logical tiles
    from k_first: those holding a key some row of the tile sees) and their spans
    [span_lo, span_hi)."""
    first_pos = q_start + qt * BLOCK
    last_pos = tl.minimum(q_start + T, first_pos + BLOCK) - 1
    lo_pos = k_first + shift
    if HAS_WINDOW:
        lo_pos = tl.maximum(lo_pos, first_pos - window + 1)
    hi_pos = tl.minimum(k_first + shift + S, last_pos + 1)
    lo = (lo_pos - k_first) // BLOCK
    hi = tl.where(hi_pos > lo_pos, (hi_pos - 1 - k_first) // BLOCK + 1, lo)
    span_lo = (k_first + lo * BLOCK) // SPAN
    span_hi = tl.where(hi > lo, (k_first + hi * BLOCK - 1) // SPAN + 1, span_lo)
    return lo, hi, span_lo, span_hi


@triton.jit
def _key_tile(q, acc, m, l, kt, q_pos, rows_ptr, k_ptr, v_ptr, tiles_ptr, qt, num_k_tiles, S,
              k_start, window, scale_log2, kvh, d, stride_kt, stride_kh, stride_vt, stride_vh,
              BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr, INDEXED: tl.constexpr,
              MASKED: tl.constexpr, TILES: tl.constexpr):
    """Key tiles kt .. kt + TILES - 1 folded into the online softmax (m, l, acc) as one block.
    MASKED (TILES = 1): a PARTIAL tile (or the last one, past S), positions checked; else FULL
    tiles of S's keys, no mask at all. Float32 keys (a float32 cache) multiply in float32, not
    Triton's default TF32."""
    r = tl.arange(0, TILES * BLOCK)
    rk = kt * BLOCK + r
    if INDEXED:  # a tile's rows are consecutive store rows: read where each tile's first is
        first = tl.load(rows_ptr + kt * BLOCK).to(tl.int64)
        if TILES == 1:
            rk64 = (first + r)[:, None]
        else:
            second = tl.load(rows_ptr + (kt + 1) * BLOCK).to(tl.int64)
            rk64 = tl.where(r < BLOCK, first + r, second + (r - BLOCK))[:, None]
    else:
        rk64 = rk[:, None].to(tl.int64)
    k_at = k_ptr + rk64 * stride_kt + kvh * stride_kh + d[None, :]
    v_at = v_ptr + rk64 * stride_vt + kvh * stride_vh + d[None, :]
    if MASKED:
        k_mask = rk < S
        k = tl.load(k_at, mask=k_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        full = tl.load(tiles_ptr + qt * num_k_tiles + kt) == 2  # FULL
        k_pos = k_start + rk
        visible = (k_pos[None, :] <= q_pos[:, None]) | full
        if HAS_WINDOW:
            visible &= ((q_pos[:, None] - k_pos[None, :]) < window) | full
        s = tl.where(visible & k_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # NOTE: a row may see nothing in its first tile (window edge): keep its max at 0.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        v = tl.load(v_at, mask=k_mask[:, None], other=0.0)
    else:
        k = tl.load(k_at)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = m_new
        v = tl.load(v_at)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l


# NOTE: lengths, positions and the classifier's offsets in the step's metadata vary from one forward
# to the next; left unspecialized, they need no compile the warm-up did not do
# (muser/startup/warmup.py)
@triton.jit(do_not_specialize=["T", "S", "q_start", "k_start", "num_k_tiles", "splits"],
            do_not_specialize_on_alignment=["tiles_ptr", "ranges_ptr", "rows_ptr"])
def _flash_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, o_ptr, part_ptr, ml_ptr, tiles_ptr, ranges_ptr, T, S,
    q_start, k_start, window, scale_log2, num_k_tiles, stride_qt, stride_qh, stride_kt,
    stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, splits, G: tl.constexpr,
    D: tl.constexpr, BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr, INDEXED: tl.constexpr,
    PACK: tl.constexpr, WIDE: tl.constexpr, DOT: tl.constexpr,
):
    qt, group, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q, h, kvh, rq, q_mask, d = _query_tile(q_ptr, qt, group, T, stride_qt, stride_qh, G, D,
                                           BLOCK, PACK, DOT)
    q_pos = q_start + rq
    m = tl.full((PACK * BLOCK,), float("-inf"), tl.float32)
    l = tl.zeros((PACK * BLOCK,), tl.float32)
    acc = tl.zeros((PACK * BLOCK, D), tl.float32)
    lo = tl.load(ranges_ptr + 4 * qt)
    full_lo = tl.load(ranges_ptr + 4 * qt + 1)
    full_hi = tl.minimum(tl.load(ranges_ptr + 4 * qt + 2), S // BLOCK)  # whole tiles only
    full_lo = tl.minimum(full_lo, full_hi)
    hi = tl.load(ranges_ptr + 4 * qt + 3)
    if splits > 1:  # this program's share of the query tile's key tiles
        per = tl.cdiv(hi - lo, splits)
        lo = lo + split * per
        hi = tl.minimum(hi, lo + per)
    # [lo, hi) in three runs: PARTIAL tiles; the FULL ones WIDE at a time without a mask;
    # the rest (PARTIAL, or a FULL tile left over) masked
    run_lo = tl.maximum(lo, full_lo)
    run_hi = run_lo + tl.maximum(tl.minimum(hi, full_hi) - run_lo, 0) // WIDE * WIDE
    for kt in range(lo, tl.minimum(hi, full_lo)):
        acc, m, l = _key_tile(q, acc, m, l, kt, q_pos, rows_ptr, k_ptr, v_ptr, tiles_ptr, qt,
                              num_k_tiles, S, k_start, window, scale_log2, kvh, d, stride_kt,
                              stride_kh, stride_vt, stride_vh, BLOCK, HAS_WINDOW, INDEXED, True,
                              1)
    for kt in range(run_lo, run_hi, WIDE):
        acc, m, l = _key_tile(q, acc, m, l, kt, q_pos, rows_ptr, k_ptr, v_ptr, tiles_ptr, qt,
                              num_k_tiles, S, k_start, window, scale_log2, kvh, d, stride_kt,
                              stride_kh, stride_vt, stride_vh, BLOCK, HAS_WINDOW, INDEXED, False,
                              WIDE)
    for kt in range(tl.maximum(lo, run_hi), hi):
        acc, m, l = _key_tile(q, acc, m, l, kt, q_pos, rows_ptr, k_ptr, v_ptr, tiles_ptr, qt,
                              num_k_tiles, S, k_start, window, scale_log2, kvh, d, stride_kt,
                              stride_kh, stride_vt, stride_vh, BLOCK, HAS_WINDOW, INDEXED, True,
                              1)
    if splits == 1:
        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(o_ptr + rq[:, None].to(tl.int64) * stride_ot + h[:, None] * stride_oh
                 + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask[:, None])
    else:  # partials [splits, T, H, D] and (max, sum) [splits, T, H, 2], float32
        H = tl.num_programs(1) * PACK
        cell = (split * T + rq).to(tl.int64) * H + h
        tl.store(part_ptr + cell[:, None] * D + d[None, :], acc, mask=q_mask[:, None])
        tl.store(ml_ptr + cell * 2, m, mask=q_mask)
        tl.store(ml_ptr + cell * 2 + 1, l, mask=q_mask)


@triton.jit(do_not_specialize=["T", "splits"])
def _combine_kernel(part_ptr, ml_ptr, o_ptr, T, H, stride_ot, stride_oh, splits,
                    D: tl.constexpr):
    """One (row, head): the splits' partials merged in split order."""
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D)
    m_all = tl.full((), float("-inf"), tl.float32)
    for s in range(splits):
        m_all = tl.maximum(m_all, tl.load(ml_ptr + ((s * T + t).to(tl.int64) * H + h) * 2))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for s in range(splits):
        cell = (s * T + t).to(tl.int64) * H + h
        w = tl.exp2(tl.load(ml_ptr + cell * 2) - m_safe)
        l += w * tl.load(ml_ptr + cell * 2 + 1)
        acc += w * tl.load(part_ptr + cell * D + d)
    out = acc / tl.maximum(l, 1e-30)
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


@triton.jit
def _exact_tile(q, acc, m, l, kt, q_pos, rows_ptr, k_ptr, v_ptr, S, k_first, shift, window,
                scale_log2, kvh, d, stride_kt, stride_kh, stride_vt, stride_vh,
                BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr, INDEXED: tl.constexpr,
                D: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr):
    """Key tile kt of the exact route: logical keys k_first + kt * BLOCK .., of which the given
    ones are indices i - shift (i < shift and i >= S + shift: none), folded by softmax.fold;
    FP8: packed rows, dequantized to the dot dtype DOT (kv_fp8.py)."""
    r = tl.arange(0, BLOCK)
    i = kt * BLOCK + r - shift  # index into the given keys
    given = (i >= 0) & (i < S)
    if INDEXED:  # a tile's rows are consecutive store rows
        at = kt * BLOCK - shift
        first = tl.load(rows_ptr + tl.maximum(at, 0)).to(tl.int64) + tl.minimum(at, 0)
        rk64 = first + r
    else:
        rk64 = i.to(tl.int64)
    k = load_heads(k_ptr, rk64 * stride_kt + kvh * stride_kh, d, given, D, FP8, DOT)
    v = load_heads(v_ptr, rk64 * stride_vt + kvh * stride_vh, d, given, D, FP8, DOT)
    k_pos = k_first + kt * BLOCK + r
    visible = given[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    return fold(q, acc, m, l, k, v, visible, scale_log2, BLOCK)


@triton.jit(do_not_specialize=["T", "S", "q_start", "k_first", "shift"],
            do_not_specialize_on_alignment=["rows_ptr"])
def _flash_exact_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, o_ptr, part_ptr, ml_ptr, T, S, q_start, k_first, shift,
    window, scale_log2, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    SPAN: tl.constexpr, HAS_WINDOW: tl.constexpr, INDEXED: tl.constexpr, PACK: tl.constexpr,
    SPLIT: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr,
):
    """The exact route (softmax.py). Keys are the given S at logical k_first + shift ..
    (k_first a multiple of BLOCK). Program (query tile, head group, z) walks the key tiles its
    rows see, span by span: in registers, merging each span into the running sums (SPLIT
    False, z = 0), or only its tile's z-th span, whose partial it stores for
    `_exact_combine_kernel` (SPLIT). FP8: the keys and values are packed rows (kv_fp8.py)."""
    qt, group, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q, h, kvh, rq, q_mask, d = _query_tile(q_ptr, qt, group, T, stride_qt, stride_qh, G, D,
                                           BLOCK, PACK, DOT)
    q_pos = q_start + rq
    lo, hi, span_lo, span_hi = _tile_spans(qt, T, q_start, k_first, shift, S, window, BLOCK,
                                           SPAN, HAS_WINDOW)
    if SPLIT:
        span_lo += z
        span_hi = tl.minimum(span_hi, span_lo + 1)
    M = tl.full((PACK * BLOCK,), float("-inf"), tl.float32)
    L = tl.zeros((PACK * BLOCK,), tl.float32)
    A = tl.zeros((PACK * BLOCK, D), tl.float32)
    for span in range(span_lo, span_hi):
        t0 = tl.maximum(lo, (span * SPAN - k_first) // BLOCK)
        t1 = tl.minimum(hi, (span * SPAN + SPAN - k_first) // BLOCK)
        m = tl.full((PACK * BLOCK,), float("-inf"), tl.float32)
        l = tl.zeros((PACK * BLOCK,), tl.float32)
        acc = tl.zeros((PACK * BLOCK, D), tl.float32)
        for kt in range(t0, t1):
            acc, m, l = _exact_tile(q, acc, m, l, kt, q_pos, rows_ptr, k_ptr, v_ptr, S, k_first,
                                    shift, window, scale_log2, kvh, d, stride_kt, stride_kh,
                                    stride_vt, stride_vh, BLOCK, HAS_WINDOW, INDEXED, D, FP8,
                                    DOT)
        if SPLIT:
            M, L, A = m, l, acc
        else:
            M, x, y = merge_weights(M, m)
            L = L * x + l * y
            A = A * x[:, None] + acc * y[:, None]
    if SPLIT:  # partials [spans, T, H, D] and (max, sum) [spans, T, H, 2], float32
        H = tl.num_programs(1) * PACK
        cell = (z * T + rq).to(tl.int64) * H + h
        keep = q_mask & (span_lo < span_hi)
        tl.store(part_ptr + cell[:, None] * D + d[None, :], A, mask=keep[:, None])
        tl.store(ml_ptr + cell * 2, M, mask=keep)
        tl.store(ml_ptr + cell * 2 + 1, L, mask=keep)
    else:
        out = A / tl.maximum(L, 1e-30)[:, None]
        tl.store(o_ptr + rq[:, None].to(tl.int64) * stride_ot + h[:, None] * stride_oh
                 + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask[:, None])


@triton.jit(do_not_specialize=["T", "q_start", "k_first", "shift"])
def _exact_combine_kernel(part_ptr, ml_ptr, o_ptr, T, H, q_start, k_first, shift, S, window,
                          stride_ot, stride_oh, D: tl.constexpr, BLOCK: tl.constexpr,
                          SPAN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """One (row, head): the spans its query tile stored, merged in span order (as decode's
    `_decode_span_merge_kernel` and the in-register path merge them)."""
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D)
    _, _, span_lo, span_hi = _tile_spans(t // BLOCK, T, q_start, k_first, shift, S, window,
                                         BLOCK, SPAN, HAS_WINDOW)
    spans = span_hi - span_lo
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for z in range(spans):
        cell = (z * T + t).to(tl.int64) * H + h
        m, x, y = merge_weights(m, tl.load(ml_ptr + cell * 2))
        l = l * x + tl.load(ml_ptr + cell * 2 + 1) * y
        acc = acc * x + tl.load(part_ptr + cell * D + d) * y
    out = acc / tl.maximum(l, 1e-30)
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
             out.to(o_ptr.dtype.element_ty))


_LOG2E = math.log2(math.e)


@dataclass(frozen=True, slots=True)
class FlashConfig:
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    pack: int = 1  # query heads of one key/value head per program
    wide: int = 1  # key tiles per block in the run of FULL tiles (1 or 2)


# NOTE: a split count is a runtime argument (one compiled kernel for every count: the warm-up's
# chunks, a few thousand keys deep, compile what a chunk at 131k runs). Splitting pays only
# while the (query tile, head) grid leaves SMs idle (bench/prefill_depth.py; docs/gpu-notes.md).
MIN_TILES_PER_SPLIT = 16
SMS = 132  # an H200's multiprocessors
SHARED = 232448  # bytes of shared memory a program may take on sm_90 (227 KB)


def shared_bytes(pack: int, wide: int, stages: int, head_dim: int, tile: int,
                 itemsize: int) -> int:
    """An upper bound of the shared memory the compiled kernel holds: three key + value buffers
    of `wide` tiles (fewer below num_stages 3) and the program's query rows. The bound keeps
    float32 configs (pack 2, wide 2, num_stages 5, head_dim 128: 458,752 bytes) out of launches
    the GPU refuses; the rule's own float32 configs compile within SHARED
    (tests/ops/test_sm90_compile.py)."""
    return (min(stages, 3) * 2 * wide + pack) * tile * head_dim * itemsize


def launch_config(q_tiles: int, heads: int, kv_heads: int, k_tiles: int, head_dim: int,
                  tile: int, in_place: bool = False, itemsize: int = 2) -> FlashConfig:
    """The launch rule. Two query heads of a key/value head per program where their rows fit
    one 128-row tile of head_dim <= 128 (half the key/value loads, a taller tensor-core tile),
    on eight warps (two warpgroups of 64 rows; ~245 registers a thread, one program per SM)
    with three key/value buffers of 128 keys (the FULL run two tiles a block) in flight:
    num_stages 3, or 5 reading the store in place, whose per-tile row number is a load of its
    own and takes pipeline stages before the tile's loads (the compiled kernel holds three
    buffers either way; 5 on contiguous keys would need more shared memory than an SM has).
    Otherwise four warps (eight for head_dim > 128), two programs per SM. Where the buffers of
    `itemsize`-byte keys (float32) would not fit SHARED: one head a program, then fewer stages.
    Then split the key range while the grid stays within the programs the SMs hold at once and
    each split walks at least MIN_TILES_PER_SPLIT tiles (the rule's figures at depth:
    bench/results/prefill_depth_h200.json, docs/gpu.md)."""
    pack = 2 if (heads // kv_heads) % 2 == 0 and head_dim <= 128 and tile <= 64 else 1
    if pack == 2 and shared_bytes(2, 2, 3, head_dim, tile, itemsize) <= SHARED:
        warps, stages, room, wide = 8, 5 if in_place else 3, SMS, 2
    else:
        pack, warps, stages, room, wide = 1, 8 if head_dim > 128 else 4, 3, 2 * SMS, 1
        while stages > 1 and shared_bytes(1, 1, stages, head_dim, tile, itemsize) > SHARED:
            stages -= 1
    programs, splits = q_tiles * heads // pack, 1
    while (programs * splits * 2 <= room and splits < 8
           and k_tiles >= 2 * splits * MIN_TILES_PER_SPLIT):
        splits *= 2
    return FlashConfig(splits, warps, stages, pack, wide)


def classifier_ranges(tiles: torch.Tensor) -> torch.Tensor:
    """tiles: int8 [QT, KT] classifier -> int32 [QT, 4]: each query tile's non-empty key tiles
    [first, last + 1) and, within them, its FULL ones [full_first, full_last + 1) (one run: a
    query tile sees a contiguous key range; (last + 1, last + 1) when none; (0, 0, 0, 0) for a
    query tile that sees nothing)."""
    cols = torch.arange(tiles.shape[1], device=tiles.device)

    def run(member: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = torch.where(member, cols, tiles.shape[1]).amin(1)
        last = torch.where(member, cols, -1).amax(1) + 1
        return torch.where(last > 0, first, 0), last.clamp(min=0)

    first, last = run(tiles != EMPTY)
    full_first, full_last = run(tiles == FULL)
    none = full_last == 0
    full_first, full_last = torch.where(none, last, full_first), torch.where(none, last, full_last)
    return torch.stack((first, full_first, full_last, last), 1).to(torch.int32).contiguous()


def prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int, k_start: int,
    window: int | None, scale: float, tiles: torch.Tensor | None, tile: int, route=None,
    tile_ranges: torch.Tensor | None = None, read_rows: torch.Tensor | None = None,
    config: FlashConfig | None = None, dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; keys/values: [S, KVH, D] (unit last stride) at positions k_start.., or,
    with read_rows [S] (device ints, consecutive within each tile of `tile` rows), the layer's
    store [R, KVH, D] whose rows read_rows are the keys in order -> [T, H, D] in the keys'
    dtype. FP8 keys/values (packed [.., KVH, D + 4], kv_fp8.py): read on the exact route only,
    dequantized to `dtype`, the dots' and the output's. tiles: the int8 classifier at `tile`
    (computed if None). config: the launch (default: `launch_config`'s rule)."""
    assert head_dim_of(keys) == q.shape[2] and keys.dtype == values.dtype
    if route == Route.FALLBACK_F32:
        if read_rows is not None:
            keys, values = keys[read_rows], values[read_rows]
        return reference_attention(q, keys, values, q_start, k_start, window, scale, None,
                                     tile, route)
    num_q, heads, head_dim = q.shape
    num_k = keys.shape[0] if read_rows is None else read_rows.shape[0]
    kv_heads = keys.shape[1]
    (qs0, qs1, qs2), (ks0, ks1, ks2), (vs0, vs1, vs2) = q.stride(), keys.stride(), values.stride()
    assert qs2 == 1 and ks2 == 1 and vs2 == 1
    dev = q.device
    if switches_in_force().exact:
        if read_rows is not None and tile % KEY_TILE:  # rows consecutive in smaller tiles only
            keys, values, read_rows = keys[read_rows], values[read_rows], None
        return _exact(q, keys, values, read_rows, q_start, k_start, window, scale, config, dtype)
    if is_fp8(keys):
        raise MuserError("an FP8 KV cache is read on the exact attention route only (the "
                         "`exact` switch is on in serving; docs/exactness.md)")
    if tiles is None:
        tiles = classify_tiles(q_start, num_q, k_start, num_k, window, tile, tile)
    if tiles.device != dev:
        tiles = tiles.to(dev)
    ranges = classifier_ranges(tiles) if tile_ranges is None else tile_ranges
    q_tiles, k_tiles = tiles.shape
    assert FULL == 2 and q_tiles == cdiv(num_q, tile) and k_tiles == cdiv(num_k, tile)
    assert tiles.is_contiguous()
    cfg = config or launch_config(q_tiles, heads, kv_heads, k_tiles, head_dim, tile,
                                  read_rows is not None, keys.element_size())
    assert (heads // kv_heads) % cfg.pack == 0, "packed heads must share a key/value head"
    assert cfg.wide in (1, 2), "the FULL run's blocks are one or two key tiles"
    out = empty((num_q, heads, head_dim), keys.dtype, dev)
    part = ml = out  # NOTE: unused without splits (a placeholder pointer)
    if cfg.splits > 1:
        part = empty((cfg.splits, num_q, heads, head_dim), torch.float32, dev)
        ml = empty((cfg.splits, num_q, heads, 2), torch.float32, dev)
    rows = keys if read_rows is None else read_rows
    launch(
        _flash_kernel, (q_tiles, heads // cfg.pack, cfg.splits), q, keys, values, rows, out, part,
        ml, tiles, ranges, num_q, num_k, q_start, k_start, window or 0, scale * _LOG2E, k_tiles,
        qs0, qs1, ks0, ks1, vs0, vs1, heads * head_dim, head_dim, cfg.splits,
        G=heads // kv_heads, D=head_dim, BLOCK=tile, HAS_WINDOW=window is not None,
        INDEXED=read_rows is not None, PACK=cfg.pack, WIDE=cfg.wide,
        DOT=dot_code(keys.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.splits > 1:
        launch(_combine_kernel, (num_q, heads), part, ml, out, num_q, heads, heads * head_dim,
               head_dim, cfg.splits, D=head_dim, num_warps=1)
    return out


def exact_config(q_tiles: int, heads: int, spans: int, head_dim: int) -> FlashConfig:
    """The exact route's launch: one head's EXACT_ROWS query rows a program on exact_warps
    warps (decode's tile shape); its spans merged in registers unless the grid leaves most SMs
    idle and there are spans to spread, then a span a program (`splits` > 1)."""
    splits = spans if q_tiles * heads * 2 <= SMS and spans > 1 else 1
    return FlashConfig(splits, exact_warps(head_dim), 2, 1, 1)


def _exact(q, keys, values, read_rows, q_start, k_start, window, scale, config, dtype):
    """prefill_attention on the exact route (softmax.py)."""
    num_q, heads, head_dim = q.shape
    num_k = keys.shape[0] if read_rows is None else read_rows.shape[0]
    kv_heads, dev, tile = keys.shape[1], q.device, KEY_TILE
    fp8 = is_fp8(keys)
    assert not fp8 or (keys.shape[2] == packed(head_dim) and dtype is not None)
    dot = dtype if fp8 else keys.dtype
    assert EXACT_ROWS == KEY_TILE, "the kernel's BLOCK is both"
    shift = k_start % tile
    k_first = k_start - shift
    q_tiles = cdiv(num_q, tile)
    spans = cdiv(k_first + shift + num_k, SPAN) - k_first // SPAN
    cfg = config or exact_config(q_tiles, heads, spans, head_dim)
    # NOTE: a config's splits > 1 asks for span programs (one a span, however many it names);
    # its pack, wide and warps do not apply (one tile shape: exact_config)
    cfg = FlashConfig(spans if cfg.splits > 1 and spans > 1 else 1, exact_warps(head_dim), 2)
    out = empty((num_q, heads, head_dim), dot, dev)
    part = ml = out  # NOTE: unused without span programs (a placeholder pointer)
    if cfg.splits > 1:
        part = empty((cfg.splits, num_q, heads, head_dim), torch.float32, dev)
        ml = empty((cfg.splits, num_q, heads, 2), torch.float32, dev)
    rows = keys if read_rows is None else read_rows
    launch(
        _flash_exact_kernel, (q_tiles, heads // cfg.pack, cfg.splits), q, keys, values, rows, out,
        part, ml, num_q, num_k, q_start, k_first, shift, window or 0, scale * _LOG2E,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), heads * head_dim, head_dim, G=heads // kv_heads, D=head_dim,
        BLOCK=tile, SPAN=SPAN, HAS_WINDOW=window is not None, INDEXED=read_rows is not None,
        PACK=cfg.pack, SPLIT=cfg.splits > 1, FP8=fp8, DOT=dot_code(dot),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.splits > 1:
        launch(_exact_combine_kernel, (num_q, heads), part, ml, out, num_q, heads, q_start,
               k_first, shift, num_k, window or 0, heads * head_dim, head_dim, D=head_dim,
               BLOCK=tile, SPAN=SPAN, HAS_WINDOW=window is not None, num_warps=1)
    return out
