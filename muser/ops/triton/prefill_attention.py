"""Prefill flash attention (causal, optionally windowed) driven by the chunk's tile classifier.

Grid (query tile, head). Each program walks only the key tiles its classifier row marks
non-empty (`tile_ranges`: [first, last + 1) per query tile, computed once per chunk and
kind), so empty tiles are never read; FULL tiles skip the position mask, PARTIAL apply it.
Online softmax in float32 with exp2; QK^T and PV on tensor cores in the cache dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from muser.attention.routes import Route
from muser.attention.tiles import EMPTY, FULL, classify_tiles
from muser.ops import ref
from muser.ops.triton.alloc import empty
from muser.ops.triton.launch import cdiv, launch


# NOTE: lengths, positions and the classifier's offsets in the step's metadata vary from one forward
# to the next; left unspecialized, they need no compile the warm-up did not do (muser/warmup.py)
@triton.jit(do_not_specialize=["T", "S", "q_start", "k_start", "num_k_tiles"],
            do_not_specialize_on_alignment=["tiles_ptr", "ranges_ptr"])
def _flash_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, tiles_ptr, ranges_ptr, T, S, q_start, k_start, window,
    scale_log2, num_k_tiles, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    qt, h = tl.program_id(0), tl.program_id(1)
    kvh = h // G
    rq = qt * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    q_mask = rq < T
    q = tl.load(q_ptr + rq[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                mask=q_mask[:, None], other=0.0).to(k_ptr.dtype.element_ty)
    q_pos = q_start + rq
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK, D), tl.float32)
    lo = tl.load(ranges_ptr + 2 * qt)
    hi = tl.load(ranges_ptr + 2 * qt + 1)
    for kt in range(lo, hi):
        rk = kt * BLOCK + tl.arange(0, BLOCK)
        k_mask = rk < S
        rk64 = rk[:, None].to(tl.int64)
        k = tl.load(k_ptr + rk64 * stride_kt + kvh * stride_kh + d[None, :],
                    mask=k_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        full = tl.load(tiles_ptr + qt * num_k_tiles + kt) == 2  # FULL
        k_pos = k_start + rk
        visible = (k_pos[None, :] <= q_pos[:, None]) | full
        if HAS_WINDOW:
            visible &= ((q_pos[:, None] - k_pos[None, :]) < window) | full
        s = tl.where(visible & k_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # NOTE: a row may see nothing in its first tile (window edge): keep its max at 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        v = tl.load(v_ptr + rk64 * stride_vt + kvh * stride_vh + d[None, :],
                    mask=k_mask[:, None], other=0.0)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(o_ptr + rq[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_mask[:, None])


_LOG2E = math.log2(math.e)


def classifier_ranges(tiles: torch.Tensor) -> torch.Tensor:
    """tiles: int8 [QT, KT] classifier -> int32 [QT, 2]: each query tile's [first, last + 1)
    non-empty key tile ((0, 0) when none)."""
    nonempty = tiles != EMPTY
    cols = torch.arange(tiles.shape[1], device=tiles.device)
    first = torch.where(nonempty, cols, tiles.shape[1]).amin(1)
    last = torch.where(nonempty, cols, -1).amax(1) + 1
    first = torch.where(last > 0, first, 0)
    return torch.stack((first, last.clamp(min=0)), 1).to(torch.int32).contiguous()


def prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int, k_start: int,
    window: int | None, scale: float, tiles: torch.Tensor | None, tile: int, route=None,
    tile_ranges: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; keys/values: [S, KVH, D] (unit last stride) at positions k_start.. ->
    [T, H, D] in the keys' dtype. tiles: the int8 classifier at `tile` (computed if None)."""
    if route == Route.FALLBACK_F32:
        return ref.prefill_attention(q, keys, values, q_start, k_start, window, scale, None,
                                     tile, route)
    num_q, heads, head_dim = q.shape
    num_k, kv_heads = keys.shape[0], keys.shape[1]
    (qs0, qs1, qs2), (ks0, ks1, ks2), (vs0, vs1, vs2) = q.stride(), keys.stride(), values.stride()
    assert qs2 == 1 and ks2 == 1 and vs2 == 1
    dev = q.device
    if tiles is None:
        tiles = classify_tiles(q_start, num_q, k_start, num_k, window, tile, tile)
    if tiles.device != dev:
        tiles = tiles.to(dev)
    ranges = classifier_ranges(tiles) if tile_ranges is None else tile_ranges
    q_tiles, k_tiles = tiles.shape
    assert FULL == 2 and q_tiles == cdiv(num_q, tile) and k_tiles == cdiv(num_k, tile)
    assert tiles.is_contiguous()
    out = empty((num_q, heads, head_dim), keys.dtype, dev)
    launch(
        _flash_kernel, (q_tiles, heads), q, keys, values, out, tiles, ranges, num_q, num_k,
        q_start, k_start, window or 0, scale * _LOG2E, k_tiles, qs0, qs1, ks0, ks1, vs0, vs1,
        heads * head_dim, head_dim,
        G=heads // kv_heads, D=head_dim, BLOCK=tile, HAS_WINDOW=window is not None,
        num_warps=8 if head_dim > 128 else 4, num_stages=2,
    )
    return out
