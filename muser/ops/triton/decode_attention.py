"""Split-KV decode attention over a ring (sliding layers) or pages (global layers), with GQA.

Grid (batch, kv head, split): each program takes one split of one sequence's key range, all
query heads of its KV group at once (one K/V read per group), and writes a partial
(max, sum, acc); a second kernel merges the splits (one program per query head). Key i of a
sequence lives at

    j   = (origin + i) mod (block_size * blocks)      ring: 1 block of `capacity` rows
    row = table[j // block_size] * block_size + j % block_size

so the same kernel reads a wrapped ring and a page table; only the metadata differs. Given the
step's new rows, the kernel also stores them (store first, without a launch of its own): split
0 writes a sequence's new row while the other splits run, so no split reads that key from the
cache. Each program walks its whole key tiles without a mask (the loads stay plain copies into
the software pipeline), masks its last partial tile, and the program whose range holds the
newest key folds it in from the step's own K/V row after the loops. Given the projection's
raw rows with the norms (`norm_rope`: a step of decode rows alone), every program also gives
its query heads, and the new key, QK-norm + RoPE first: no launch of their own either, one
fewer kernel boundary a layer. Splits are a launch constant, so the kernel is safe to capture
in a CUDA graph.

That is the route with the `exact` switch off. The exact route, the default, runs
`_decode_span_kernel`: one program per span of keys anchored at logical positions, merged in
span order by `_decode_span_merge_kernel`, the arithmetic prefill's `_flash_exact_kernel` gives
the same row (softmax.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from muser.errors import MuserError
from muser.ops.kv_fp8 import head_dim_of, is_fp8, packed
from muser.ops.triton.alloc import empty
from muser.ops.triton.kv_fp8 import dot_code, load_heads, quantize_heads, store_heads, to_dot
from muser.ops.triton.launch import launch, next_power_of_2
from muser.ops.triton.pdl import enter, options
from muser.ops.triton.qk_norm_rope import norm_rope_whole, whole_angles, whole_weight
from muser.ops.triton.softmax import KEY_TILE, SPAN, fold, merge_weights
from muser.ops.triton.switches import current as switches_in_force


@triton.jit
def _kv_tile(i, valid, origin, wrap, table_ptr, b, stride_t, block_size, k_ptr, v_ptr, kvh, d,
             KVH: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr,
             ONE_BLOCK: tl.constexpr, FP8: tl.constexpr = False, DOT: tl.constexpr = 0):
    """The K and V rows [BLOCK_N, D] of keys i (logical indices); 0 where not valid. With
    ONE_BLOCK (a ring, or a page table of one block) every key is in the table's first block:
    its load depends on no key index, so it is in flight with the sequence's metadata. FP8
    (MASKED): packed rows, dequantized to the dot dtype DOT (kv_fp8.py)."""
    j = (origin + i) % wrap
    if ONE_BLOCK:
        row = tl.load(table_ptr + b * stride_t).to(tl.int64) * block_size + j
    else:
        if MASKED:
            blk = tl.load(table_ptr + b * stride_t + j // block_size, mask=valid, other=0)
        else:
            blk = tl.load(table_ptr + b * stride_t + j // block_size)
        row = blk.to(tl.int64) * block_size + j % block_size
    if FP8:
        at_fp8 = (row * KVH + kvh) * (D + 4)
        k = load_heads(k_ptr, at_fp8, d, valid, D, True, DOT)
        v = load_heads(v_ptr, at_fp8, d, valid, D, True, DOT)
    else:
        at = (row * KVH + kvh)[:, None] * D + d[None, :]
        if MASKED:
            k = tl.load(k_ptr + at, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + at, mask=valid[:, None], other=0.0)  # in flight with K's load
        else:
            k = tl.load(k_ptr + at)
            v = tl.load(v_ptr + at)
    return k, v


@triton.jit
def _fold(q, acc, m, l, k, v, valid, scale_log2, MASKED: tl.constexpr):
    """One tile of keys (k, v) folded into the online softmax (m, l, acc); float32 keys (a
    float32 cache) multiply in float32, not Triton's default TF32."""
    if MASKED:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: a tile of no key
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = m_new
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l


@triton.jit
def _key_tile(q, acc, m, l, i, valid, origin, wrap, table_ptr, b, stride_t, block_size, k_ptr,
              v_ptr, kvh, d, scale_log2, KVH: tl.constexpr, D: tl.constexpr,
              MASKED: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One tile of keys i (logical indices) loaded and folded into (m, l, acc)."""
    k, v = _kv_tile(i, valid, origin, wrap, table_ptr, b, stride_t, block_size, k_ptr, v_ptr,
                    kvh, d, KVH, D, MASKED, ONE_BLOCK)
    return _fold(q, acc, m, l, k, v, valid, scale_log2, MASKED)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, src_ptr, dst_ptr, table_ptr, starts_ptr, lens_ptr,
    origins_ptr, mid_o, mid_ml, qw_ptr, kw_ptr, cos_ptr, sin_ptr, H, stride_qb, stride_qh,
    stride_kn, stride_vn, stride_t, stride_c, num_blocks, block_size, scale_log2, eps,
    KVH: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, NEW: tl.constexpr, NORM: tl.constexpr,
    ONE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # NOTE: the step's metadata was uploaded before its first kernel: read before the wait
    start = tl.load(starts_ptr + b)
    length = tl.load(lens_ptr + b)
    origin = tl.load(origins_ptr + b)
    per_split = tl.cdiv(tl.cdiv(tl.maximum(length - start, 0), SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, length)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kvh * G + g
    g_mask = g < G
    wrap = block_size * num_blocks
    # Keys lo .. hi - 1: whole tiles without a mask, then the rest masked. With NEW the newest
    # key (length - 1) is read from the input after the loops, never from its cache row, which
    # split 0 may be storing right now: the tiles' loads stay plain copies into the pipeline.
    last = length - 1 if NEW else length
    whole = lo + tl.maximum(tl.minimum(hi, last) - lo, 0) // BLOCK_N * BLOCK_N
    first = lo
    if NEW:
        # NOTE: then every cached key this program reads was stored by an earlier step (this
        # one's own row comes from the input): its first tile, whole or partial (the split
        # that holds the newest key has 31 of a ring's 32 there), is loaded before the wait,
        # in flight while the kernels before finish (pdl.py); so are the new row's indices
        i = lo + tl.arange(0, BLOCK_N)
        first_valid = i < tl.minimum(hi, last)
        k0, v0 = _kv_tile(i, first_valid, origin, wrap, table_ptr, b, stride_t, block_size,
                          k_ptr, v_ptr, kvh, d, KVH, D, True, ONE_BLOCK)
        first = lo + BLOCK_N
        src = tl.load(src_ptr + b).to(tl.int64)
        dst = tl.load(dst_ptr + b).to(tl.int64)
    if NORM:  # the norms' weights and the row's cos, sin: written before the step's kernels
        qw, qwp = whole_weight(qw_ptr, D // 2)
        kw, kwp = whole_weight(kw_ptr, D // 2)
        cs, sn = whole_angles(cos_ptr + b * stride_c, sin_ptr + b * stride_c, D // 2)
    enter(PDL)
    q_at = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_at + d[None, :], mask=g_mask[:, None], other=0.0)
    if NORM:  # QK-norm + RoPE of the projection's raw rows, here rather than a launch before
        qp = tl.load(q_at + ((d + D // 2) % D)[None, :], mask=g_mask[:, None], other=0.0)
        q = norm_rope_whole(q.to(tl.float32), qp.to(tl.float32), qw, qwp, cs, sn, eps, D // 2)
    if NEW:  # the step's new row, in flight with q (stored by split 0 after the loops)
        k_at = kn_ptr + src * stride_kn + kvh * D
        k_new = tl.load(k_at + d)
        v_new = tl.load(vn_ptr + src * stride_vn + kvh * D + d).to(v_ptr.dtype.element_ty)
        if NORM:
            kp = tl.load(k_at + (d + D // 2) % D)
            k_new = tl.reshape(norm_rope_whole(k_new.to(tl.float32)[None, :],
                                               kp.to(tl.float32)[None, :], kw, kwp, cs, sn, eps,
                                               D // 2), (D,))
        k_new = k_new.to(k_ptr.dtype.element_ty)
    q = q.to(k_ptr.dtype.element_ty)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    if NEW:
        acc, m, l = _fold(q, acc, m, l, k0, v0, first_valid, scale_log2, True)
    for i0 in range(first, whole, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        acc, m, l = _key_tile(q, acc, m, l, i, i < hi, origin, wrap, table_ptr, b, stride_t,
                              block_size, k_ptr, v_ptr, kvh, d, scale_log2, KVH, D, False,
                              ONE_BLOCK)
    for i0 in range(tl.maximum(whole, first), hi, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        acc, m, l = _key_tile(q, acc, m, l, i, (i < hi) & (i != last), origin, wrap, table_ptr,
                              b, stride_t, block_size, k_ptr, v_ptr, kvh, d, scale_log2, KVH, D,
                              True, ONE_BLOCK)
    if NEW:  # the step's new row: stored by split 0, attended by the split that holds it
        at_new = (dst * KVH + kvh) * D + d
        store = (d < D) & (dst >= 0) & (split == 0)  # NOTE: dst < 0: a padding row
        tl.store(k_ptr + at_new, k_new, mask=store)
        tl.store(v_ptr + at_new, v_new, mask=store)
        if (lo <= last) & (last < hi):
            s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale_log2
            m_new = tl.maximum(m, s)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new)
            l = l * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
            m = m_new
    part = (b * H + heads) * SPLITS + split
    tl.store(mid_o + part[:, None] * D + d[None, :], acc, mask=g_mask[:, None])
    tl.store(mid_ml + part * 2, m, mask=g_mask)
    tl.store(mid_ml + part * 2 + 1, l, mask=g_mask)


@triton.jit
def _decode_merge_kernel(mid_o, mid_ml, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                         PDL: tl.constexpr):
    enter(PDL)
    bh = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(mid_ml + (bh * SPLITS + s) * 2)
    l = tl.load(mid_ml + (bh * SPLITS + s) * 2 + 1)
    m_max = tl.max(m, axis=0)
    # NOTE: empty splits (l == 0, m == -inf) weigh nothing; a padding row (all empty) gives 0.
    w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)
    o = tl.load(mid_o + (bh * SPLITS + s)[:, None] * D + d[None, :])
    num = tl.sum(o * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    out = num / tl.maximum(den, 1e-30)
    tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _decode_span_kernel(
    q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, src_ptr, dst_ptr, table_ptr, starts_ptr, lens_ptr,
    origins_ptr, mid_o, mid_ml, H, stride_qb, stride_qh, stride_kn, stride_vn, stride_t,
    num_blocks, block_size, scale_log2, KVH: tl.constexpr, G: tl.constexpr,
    BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr,
    SPLITS: tl.constexpr, NEW: tl.constexpr, ONE_BLOCK: tl.constexpr, FP8: tl.constexpr,
    DOT: tl.constexpr, PDL: tl.constexpr,
):
    """The exact route (softmax.py): program (b, kv head, s) folds the keys of sequence b's
    s-th span, from the span holding its first key, in key tiles anchored at logical
    positions, into a partial of its own. With NEW the step's new row is stored by s = 0 and
    enters the tile holding it from the input (the same values the store writes: with FP8 its
    codes, quantized here, dequantized), so no program reads that cache row. DOT: the dots'
    dtype (the cache's; FP8: the model's), kv_fp8.py."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + b)
    length = tl.load(lens_ptr + b)
    origin = tl.load(origins_ptr + b)
    span = start // SPAN + split
    lo = tl.maximum(start, span * SPAN)
    hi = tl.minimum(length, span * SPAN + SPAN)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kvh * G + g
    g_mask = g < G
    wrap = block_size * num_blocks
    last = length - 1
    if NEW:
        src = tl.load(src_ptr + b).to(tl.int64)
        dst = tl.load(dst_ptr + b).to(tl.int64)
    enter(PDL)
    q = to_dot(tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                       mask=g_mask[:, None], other=0.0), DOT)
    if NEW:
        k_new = tl.load(kn_ptr + src * stride_kn + kvh * D + d)
        v_new = tl.load(vn_ptr + src * stride_vn + kvh * D + d)
        if FP8:  # the new row's codes: stored below, and their values attended
            k_codes, k_scale, k_new = quantize_heads(k_new.to(tl.float32)[None, :])
            v_codes, v_scale, v_new = quantize_heads(v_new.to(tl.float32)[None, :])
            k_new, v_new = tl.reshape(k_new, (D,)), tl.reshape(v_new, (D,))
        k_new, v_new = to_dot(k_new, DOT), to_dot(v_new, DOT)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    for i0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        valid = (i >= lo) & (i < hi)
        k, v = _kv_tile(i, valid, origin, wrap, table_ptr, b, stride_t, block_size, k_ptr, v_ptr,
                        kvh, d, KVH, D, True, ONE_BLOCK, FP8, DOT)
        if NEW:
            newest = (i == last)[:, None]
            k = tl.where(newest, k_new[None, :], k)
            v = tl.where(newest, v_new[None, :], v)
        acc, m, l = fold(q, acc, m, l, k, v, valid[None, :], scale_log2, BLOCK_N)
    if NEW and FP8:
        at_row = tl.full((1,), 0, tl.int64) + (dst * KVH + kvh) * (D + 4)
        keep = tl.full((1,), 1, tl.int1) & (dst >= 0) & (split == 0)  # NOTE: dst < 0: padding
        store_heads(k_ptr, at_row, d, k_codes, k_scale, keep, D)
        store_heads(v_ptr, at_row, d, v_codes, v_scale, keep, D)
    elif NEW:
        at_new = (dst * KVH + kvh) * D + d
        store = (d < D) & (dst >= 0) & (split == 0)  # NOTE: dst < 0: a padding row
        tl.store(k_ptr + at_new, k_new, mask=store)
        tl.store(v_ptr + at_new, v_new, mask=store)
    part = (b * H + heads) * SPLITS + split
    tl.store(mid_o + part[:, None] * D + d[None, :], acc, mask=g_mask[:, None])
    tl.store(mid_ml + part * 2, m, mask=g_mask)
    tl.store(mid_ml + part * 2 + 1, l, mask=g_mask)


@triton.jit
def _decode_span_merge_kernel(mid_o, mid_ml, out_ptr, starts_ptr, lens_ptr, H,
                              D: tl.constexpr, SPAN: tl.constexpr, SPLITS: tl.constexpr,
                              PDL: tl.constexpr):
    """One (sequence, head): its spans' partials merged in span order (softmax.merge_weights),
    as a prefill chunk merges them in registers."""
    enter(PDL)
    bh = tl.program_id(0)
    start = tl.load(starts_ptr + bh // H)
    length = tl.load(lens_ptr + bh // H)
    spans = tl.where(length > start, (length - 1) // SPAN - start // SPAN + 1, 0)
    d = tl.arange(0, D)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for s in range(spans):
        cell = bh * SPLITS + s
        m, x, y = merge_weights(m, tl.load(mid_ml + cell * 2))
        l = l * x + tl.load(mid_ml + cell * 2 + 1) * y
        acc = acc * x + tl.load(mid_o + cell * D + d) * y
    out = acc / tl.maximum(l, 1e-30)
    tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty))


def decode_norm_rope() -> bool:
    """Whether decode attention takes the projection's raw rows and applies QK-norm + RoPE in
    its programs (`norm_rope`): not on the exact route, whose rows are normalized by
    qk_norm_rope_pair at every width (a sum over a head held whole is laid out otherwise)."""
    return not switches_in_force().exact


def exact_spans(max_keys: int) -> int:
    """Span programs a sequence of up to `max_keys` keys may need (its first key anywhere in a
    span)."""
    return -(-max_keys // SPAN) + 1


LONG_KEYS = 4096  # key ranges at least this long take the long-range launch configuration


def launch_config(batch: int, num_kv_heads: int, head_dim: int, max_keys: int
                  ) -> tuple[int, int, int, int | None]:
    """(splits, keys per iteration, warps, pipeline stages or None for Triton's default) for a
    step whose sequences hold up to `max_keys` keys. Short ranges (rings, short contexts): 32
    keys per iteration in two stages, ~4 programs per SM of 132, at least 16 keys per split, at
    most 64 splits: at these ranges the kernel's latency, not its bytes, sets its time, so more,
    shorter splits win (bench/results/decode_short_h200.json). Long ranges: 64 keys per
    iteration and ~4 programs per SM, up to 128 splits, which read K and V at the copy
    bandwidth at 131,072 keys (bench/results/decode_depth_h200.json; docs/gpu-notes.md)."""
    want = max(1, 512 // max(1, batch * num_kv_heads))
    if max_keys < LONG_KEYS:
        by_keys = next_power_of_2(-(-max_keys // 16))
        return max(1, min(next_power_of_2(want), by_keys, 64)), 32, 4, 2
    by_keys = next_power_of_2(-(-max_keys // 64))
    return max(1, min(next_power_of_2(want), by_keys, 128)), 64, 8 if head_dim >= 256 else 4, None


def decode_attention(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, block_table: torch.Tensor,
    starts: torch.Tensor, lens: torch.Tensor, origins: torch.Tensor, block_size: int,
    scale: float, new: tuple | None = None, splits: int | None = None,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    norm_rope: tuple | None = None, dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; k/v_rows: [R, KVH, D] flat rows (FP8: packed [R, KVH, D + 4], the exact
    route only); block_table: [B, blocks] int32; starts/lens/origins: [B] int32 -> [B, H, D]
    in the cache dtype, or for FP8 in `dtype`, the dots' (zeros where lens <= starts).
    new = (k, v, src, dst): store k/v[src[b]] at row dst[b] first (ref.store_kv), in the same
    launch; the row stored for sequence b must be its newest key (logical lens[b] - 1).
    norm_rope = (q_weight, k_weight, cos, sin, eps), with new: q and new k are the projection's
    raw rows, given QK-norm + RoPE here (ref.with_norm_rope: one new row per sequence, in
    order); cos/sin: [B, D // 2] float32."""
    batch, heads, head_dim = q.shape
    kv_heads = k_rows.shape[1]
    group = heads // kv_heads
    assert q.stride(2) == 1 and k_rows.is_contiguous() and v_rows.is_contiguous()
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    assert head_dim_of(k_rows) == head_dim and k_rows.shape == v_rows.shape
    if new is not None:
        k_new, v_new, src, dst = new
        assert src.shape == dst.shape == (batch,)
        for t in (k_new, v_new):
            assert t.stride(2) == 1 and t.stride(1) == head_dim
            assert t.shape[1:] == (kv_heads, head_dim)
    else:
        k_new, v_new, src, dst = q, q, lens, lens  # unused
    if norm_rope is not None:
        assert new is not None and k_new.shape[0] == batch, "norm_rope: one new row a sequence"
        q_weight, k_weight, cos, sin, eps = norm_rope
        assert cos.shape == (batch, head_dim // 2) and cos.is_contiguous() and sin.is_contiguous()
        assert q_weight.dtype == k_weight.dtype == cos.dtype == torch.float32
    else:
        q_weight = k_weight = cos = sin = q  # unused
        eps = 0.0
    if switches_in_force().exact:
        assert norm_rope is None, "the exact route normalizes q and k before attention"
        return _exact(q, k_rows, v_rows, block_table, starts, lens, origins, block_size, scale,
                      new, k_new, v_new, src, dst, dtype)
    if is_fp8(k_rows):
        raise MuserError("an FP8 KV cache is read on the exact attention route only (the "
                         "`exact` switch is on in serving; docs/exactness.md)")
    picked = launch_config(batch, kv_heads, head_dim, block_table.shape[1] * block_size)
    splits, block_n, num_warps = splits or picked[0], block_n or picked[1], num_warps or picked[2]
    num_stages = num_stages or picked[3]
    mid_o = empty((batch, heads, splits, head_dim), torch.float32, q.device)
    mid_ml = empty((batch, heads, splits, 2), torch.float32, q.device)
    out = empty((batch, heads, head_dim), k_rows.dtype, q.device)
    block_g = max(16, next_power_of_2(group))
    launch(
        _decode_split_kernel, (batch, kv_heads, splits), q, k_rows, v_rows, k_new, v_new, src,
        dst, block_table, starts, lens, origins, mid_o, mid_ml, q_weight, k_weight, cos, sin,
        heads, q.stride(0), q.stride(1), k_new.stride(0), v_new.stride(0),
        block_table.stride(0), cos.stride(0), block_table.shape[1], block_size,
        scale * math.log2(math.e), eps, KVH=kv_heads, G=group, BLOCK_G=block_g, D=head_dim,
        BLOCK_N=block_n, SPLITS=splits, NEW=new is not None, NORM=norm_rope is not None,
        ONE_BLOCK=block_table.shape[1] == 1, num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages else {}), **options(q.device),
    )
    launch(_decode_merge_kernel, (batch * heads,), mid_o, mid_ml, out, D=head_dim,
           SPLITS=splits, **options(q.device))
    return out


def _exact(q, k_rows, v_rows, block_table, starts, lens, origins, block_size, scale, new, k_new,
           v_new, src, dst, dtype) -> torch.Tensor:
    """decode_attention on the exact route (softmax.py): a span a program, merged in order."""
    batch, heads, head_dim = q.shape
    kv_heads = k_rows.shape[1]
    group = heads // kv_heads
    fp8 = is_fp8(k_rows)
    assert not fp8 or (k_rows.shape[2] == packed(head_dim) and dtype is not None)
    dot = dtype if fp8 else k_rows.dtype
    splits = exact_spans(block_table.shape[1] * block_size)
    mid_o = empty((batch, heads, splits, head_dim), torch.float32, q.device)
    mid_ml = empty((batch, heads, splits, 2), torch.float32, q.device)
    out = empty((batch, heads, head_dim), dot, q.device)
    launch(
        _decode_span_kernel, (batch, kv_heads, splits), q, k_rows, v_rows, k_new, v_new, src, dst,
        block_table, starts, lens, origins, mid_o, mid_ml, heads, q.stride(0), q.stride(1),
        k_new.stride(0), v_new.stride(0), block_table.stride(0), block_table.shape[1],
        block_size, scale * math.log2(math.e), KVH=kv_heads, G=group,
        BLOCK_G=max(16, next_power_of_2(group)), D=head_dim, BLOCK_N=KEY_TILE, SPAN=SPAN,
        SPLITS=splits, NEW=new is not None, ONE_BLOCK=block_table.shape[1] == 1, FP8=fp8,
        DOT=dot_code(dot), num_warps=4 if head_dim <= 256 else 8, num_stages=2,
        **options(q.device),
    )
    launch(_decode_span_merge_kernel, (batch * heads,), mid_o, mid_ml, out, starts, lens, heads,
           D=head_dim, SPAN=SPAN, SPLITS=splits, **options(q.device))
    return out
