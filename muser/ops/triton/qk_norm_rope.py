"""Per-head RMSNorm then NeoX RoPE (rotate halves), HEADS heads of one row per program
(`heads_per_program`). The pair kernel can also store each row's keys and values into their
cache rows (store-first for a prefill chunk written in place, with no launch of its own)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from muser.ops.kv_fp8 import is_fp8, packed
from muser.ops.triton.alloc import empty
from muser.ops.triton.kv_fp8 import codes_of, quantize_heads, store_heads, store_tail
from muser.ops.triton.launch import launch, next_power_of_2
from muser.ops.triton.pdl import enter, options
from muser.ops.triton.quantize_fp8 import activation_scale
from muser.ops.triton.switches import current as switches_in_force


@triton.jit
def _row(ptr, HALF: tl.constexpr):
    """HALF float32 values at ptr, as [1, HALF]. NOTE: the kernels load the norm weights and
    the row's cos, sin this way before their programmatic-launch wait (pdl.py): no kernel just
    before them writes those (cos/sin come from the step's first kernels)."""
    return tl.load(ptr + tl.arange(0, HALF)[None, :])


@triton.jit
def _norm_rope_heads(x_ptr, w1, w2, c, s, n, h0, stride_xn, stride_xh, eps, HALF: tl.constexpr,
                     HEADS: tl.constexpr):
    """-> the two rotated halves [HEADS, HALF] of heads h0 .. h0 + HEADS - 1 of row n,
    float32 (w1, w2: the norm weight's halves; c, s: the row's cos, sin; each [1, HALF])."""
    d = tl.arange(0, HALF)[None, :]
    hh = (h0 + tl.arange(0, HEADS))[:, None]
    base = x_ptr + n.to(tl.int64) * stride_xn + hh * stride_xh
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    x1 = x1 * inv[:, None] * w1
    x2 = x2 * inv[:, None] * w2
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def whole_weight(w_ptr, HALF: tl.constexpr):
    """For heads held whole ([rows, 2 * HALF], as attention holds them): a norm weight at each
    d and at its rotation partner (d + HALF) mod 2 * HALF, each [2 * HALF]."""
    d = tl.arange(0, 2 * HALF)
    return tl.load(w_ptr + d), tl.load(w_ptr + (d + HALF) % (2 * HALF))


@triton.jit
def whole_angles(cos_ptr, sin_ptr, HALF: tl.constexpr):
    """A row's cos at each d and its sin signed as the rotation takes it (-sin on the first
    half), each [2 * HALF]."""
    d = tl.arange(0, 2 * HALF)
    s = tl.load(sin_ptr + d % HALF)
    return tl.load(cos_ptr + d % HALF), tl.where(d < HALF, -s, s)


@triton.jit
def norm_rope_whole(x, xp, w, wp, c, s, eps, HALF: tl.constexpr):
    """_norm_rope_heads on heads held whole: x [rows, 2 * HALF] float32, xp the same heads'
    rotation partners (x[:, (d + HALF) mod 2 * HALF]); (w, wp) from whole_weight, (c, s) from
    whole_angles -> [rows, 2 * HALF] float32 (the two halves' squares summed apart, then added,
    as there)."""
    first = tl.arange(0, 2 * HALF)[None, :] < HALF
    sq = x * x
    ss = tl.sum(tl.where(first, sq, 0.0), axis=1) + tl.sum(tl.where(first, 0.0, sq), axis=1)
    inv = tl.rsqrt(ss / (2 * HALF) + eps)[:, None]
    return x * inv * w[None, :] * c[None, :] + xp * inv * wp[None, :] * s[None, :]


@triton.jit
def _store_heads(out, y1, y2, HALF: tl.constexpr, HEADS: tl.constexpr):
    """y1, y2 [HEADS, HALF] -> out[h, :HALF], out[h, HALF:] for heads h of 2 * HALF values."""
    at = out + tl.arange(0, HEADS)[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    tl.store(at, y1.to(out.dtype.element_ty))
    tl.store(at + HALF, y2.to(out.dtype.element_ty))


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xn, stride_xh, stride_c, eps,
    HALF: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr,
):
    n, h = tl.program_id(0), tl.program_id(1) * HEADS
    w1, w2 = _row(w_ptr, HALF), _row(w_ptr + HALF, HALF)
    c, s = _row(cos_ptr + n * stride_c, HALF), _row(sin_ptr + n * stride_c, HALF)
    enter(PDL)
    y1, y2 = _norm_rope_heads(x_ptr, w1, w2, c, s, n, h, stride_xn, stride_xh, eps, HALF, HEADS)
    _store_heads(out_ptr + (n.to(tl.int64) * H + h) * 2 * HALF, y1, y2, HALF, HEADS)


# NOTE: the store rows' offset in the step's metadata vary from one forward to the next; left
# unspecialized, they need no compile the warm-up did not do (muser/startup/warmup.py)
@triton.jit(do_not_specialize_on_alignment=["dst_ptr"])
def _qk_pair_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out, k_out, v_ptr, k_rows, v_rows, dst_ptr,
    H, KVH, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_c, eps,
    HALF: tl.constexpr, HEADS: tl.constexpr, STORE: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    n, h = tl.program_id(0), tl.program_id(1) * HEADS  # heads [0, H) are q's, then k's
    is_q = h < H
    w1 = tl.where(is_q, _row(qw_ptr, HALF), _row(kw_ptr, HALF))
    w2 = tl.where(is_q, _row(qw_ptr + HALF, HALF), _row(kw_ptr + HALF, HALF))
    c, s = _row(cos_ptr + n * stride_c, HALF), _row(sin_ptr + n * stride_c, HALF)
    enter(PDL)
    if is_q:
        y1, y2 = _norm_rope_heads(q_ptr, w1, w2, c, s, n, h, stride_qn, stride_qh, eps, HALF,
                                  HEADS)
        _store_heads(q_out + (n.to(tl.int64) * H + h) * 2 * HALF, y1, y2, HALF, HEADS)
    else:
        h -= H
        y1, y2 = _norm_rope_heads(k_ptr, w1, w2, c, s, n, h, stride_kn, stride_kh, eps, HALF,
                                  HEADS)
        _store_heads(k_out + (n.to(tl.int64) * KVH + h) * 2 * HALF, y1, y2, HALF, HEADS)
        if STORE:
            dst = tl.load(dst_ptr + n).to(tl.int64)
            if dst >= 0:  # NOTE: dst < 0: a row this launch does not store
                hh = tl.arange(0, HEADS)[:, None]
                d = tl.arange(0, 2 * HALF)[None, :]
                v = tl.load(v_ptr + n.to(tl.int64) * stride_vn + (h + hh) * stride_vh + d)
                if FP8:
                    _store_fp8(k_rows, v_rows, (dst * KVH + h) * (2 * HALF + 4), y1, y2, v,
                               HALF, HEADS)
                else:
                    at = (dst * KVH + h) * 2 * HALF
                    _store_heads(k_rows + at, y1, y2, HALF, HEADS)
                    tl.store(v_rows + at + hh * (2 * HALF) + d, v.to(v_rows.dtype.element_ty))


@triton.jit
def _store_fp8(k_rows, v_rows, at, y1, y2, v, HALF: tl.constexpr, HEADS: tl.constexpr):
    """Heads' keys (rotated halves y1, y2 [HEADS, HALF] float32) and values v [HEADS, 2 HALF]
    quantized into packed FP8 rows from element `at` on (muser/ops/kv_fp8.py)."""
    half = tl.arange(0, HALF)
    rows = at + tl.arange(0, HEADS).to(tl.int64) * (2 * HALF + 4)
    every = tl.full((HEADS,), 1, tl.int1)
    amax = tl.maximum(tl.max(tl.abs(y1), axis=1), tl.max(tl.abs(y2), axis=1))
    scale, inverse = activation_scale(amax)
    tl.store(k_rows + rows[:, None] + half[None, :], codes_of(y1, inverse))
    tl.store(k_rows + rows[:, None] + HALF + half[None, :], codes_of(y2, inverse))
    store_tail(k_rows, rows, scale, every, 2 * HALF)
    codes, scale, _ = quantize_heads(v.to(tl.float32))
    store_heads(v_rows, rows, tl.arange(0, 2 * HALF), codes, scale, every, 2 * HALF)


# NOTE: one head a program keeps a decode step's few rows spread over the SMs; a prefill chunk
# has rows enough, and one (row, head) a program there (24,576 programs of 128 values for a
# 27B chunk of 512 rows) spent more on starting programs than on the values
MAX_HEADS = 8


def heads_per_program(rows: int, *head_counts: int) -> int:
    """Heads of one row per program: 1 up to 64 rows (decode), else the largest power of two
    <= MAX_HEADS dividing every count (so a program's heads are all q's or all k's). On the
    exact route the latter at every width: a head's sum of squares is laid out by the heads a
    program holds."""
    if rows <= 64 and not switches_in_force().exact:
        return 1
    common = math.gcd(*head_counts)
    return min(MAX_HEADS, common & -common)


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """x: [N, heads, head_dim] (any strides with a unit last stride) -> [N, heads, head_dim] f32;
    cos/sin: [N, head_dim // 2] f32; weight: [head_dim] f32."""
    n, heads, head_dim = x.shape
    half = head_dim // 2
    assert x.stride(2) == 1 and half == next_power_of_2(half)
    assert cos.shape == (n, half) and cos.is_contiguous() and sin.is_contiguous()
    assert weight.dtype == torch.float32 and cos.dtype == torch.float32
    out = empty((n, heads, head_dim), torch.float32, x.device)
    if n:
        per = heads_per_program(n, heads)
        launch(_qk_norm_rope_kernel, (n, heads // per), x, weight, cos, sin, out, heads,
               x.stride(0), x.stride(1), cos.stride(0), eps, HALF=half, HEADS=per,
               **options(x.device))
    return out


def qk_norm_rope_pair(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, k_dtype: torch.dtype = torch.float32,
    store: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rope of q: [N, H, D] and k: [N, KVH, D] in one launch -> (q float32, k in
    k_dtype). store = (k_rows, v_rows, v, dst): also k_rows[dst[i]] = k[i], v_rows[dst[i]] =
    v[i] (cast to the cache dtype; quantized into an FP8 cache's packed rows) where dst[i] >= 0
    (ref.qk_norm_rope_pair)."""
    n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    half = head_dim // 2
    (qs0, qs1, qs2), (ks0, ks1, ks2) = q.stride(), k.stride()
    assert qs2 == 1 and ks2 == 1 and k.shape == (n, kv_heads, head_dim)
    assert half == next_power_of_2(half) and cos.shape == (n, half)
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32
    dev = q.device
    q_out = empty((n, heads, head_dim), torch.float32, dev)
    k_out = empty((n, kv_heads, head_dim), k_dtype, dev)
    if store is None:
        k_rows = v_rows = v = dst = k_out
    else:
        k_rows, v_rows, v, dst = store
        assert k_rows.is_contiguous() and v_rows.is_contiguous() and v.stride(2) == 1
        assert v.shape == k.shape and dst.shape == (n,)
        assert k_rows.shape[1:] == (kv_heads, packed(head_dim) if is_fp8(k_rows) else head_dim)
    vs0, vs1, _ = v.stride()
    if n:
        per = heads_per_program(n, heads, kv_heads)
        launch(_qk_pair_kernel, (n, (heads + kv_heads) // per),
               q, k, q_weight, k_weight, cos, sin, q_out, k_out, v, k_rows, v_rows, dst, heads,
               kv_heads, qs0, qs1, ks0, ks1, vs0, vs1, cos.stride(0), eps, HALF=half,
               HEADS=per, STORE=store is not None, FP8=is_fp8(k_rows), **options(dev))
    return q_out, k_out
