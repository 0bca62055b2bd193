"""Store first: copy new K/V rows into a layer's cache rows (cast to the cache dtype; an FP8
cache's rows quantized, muser/ops/kv_fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.kv_fp8 import head_dim_of, is_fp8, packed
from muser.ops.triton.kv_fp8 import quantize_heads, store_heads
from muser.ops.triton.launch import launch, next_power_of_2


# NOTE: the rows' offsets in the step's metadata vary from one forward to the next; left
# unspecialized, they need no compile the warm-up did not do (muser/startup/warmup.py)
@triton.jit(do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])
def _store_kv_kernel(k_new, v_new, k_rows, v_rows, src_ptr, dst_ptr, stride_k, stride_v,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    e = tl.arange(0, BLOCK)
    mask = (e < ROW) & (dst >= 0)  # NOTE: dst < 0 marks a padding row: it writes nothing.
    k = tl.load(k_new + src * stride_k + e, mask=mask)
    v = tl.load(v_new + src * stride_v + e, mask=mask)
    tl.store(k_rows + dst * ROW + e, k.to(k_rows.dtype.element_ty), mask=mask)
    tl.store(v_rows + dst * ROW + e, v.to(v_rows.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_row(x_ptr, rows, src, stride, at, h, d, mask, D: tl.constexpr):
    x = tl.load(x_ptr + src * stride + h[:, None] * D + d[None, :], mask=mask[:, None], other=0.0)
    codes, scale, _ = quantize_heads(x.to(tl.float32))
    store_heads(rows, at, d, codes, scale, mask, D)


@triton.jit(do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])
def _store_kv_fp8_kernel(k_new, v_new, k_rows, v_rows, src_ptr, dst_ptr, stride_k, stride_v,
                         KVH: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """One row's KV heads quantized into packed FP8 rows (kv_fp8.py)."""
    i = tl.program_id(0)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    mask = (h < KVH) & (dst >= 0)  # NOTE: dst < 0 marks a padding row: it writes nothing.
    at = (dst * KVH + h) * (D + 4)
    _quantize_row(k_new, k_rows, src, stride_k, at, h, d, mask, D)
    _quantize_row(v_new, v_rows, src, stride_v, at, h, d, mask, D)


def _rows_view_ok(t: torch.Tensor) -> bool:
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def store_kv(
    k_rows: torch.Tensor, v_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    src: torch.Tensor, dst: torch.Tensor,
) -> None:
    """k_rows[dst[i]] = k_new[src[i]] (and v); k/v_rows: [R, KVH, D] contiguous (FP8: packed
    uint8 [R, KVH, D + 4], quantized here); k/v_new: [N, KVH, D] with contiguous rows; src/dst:
    [W] int on the device; dst < 0 skips."""
    assert k_rows.is_contiguous() and v_rows.is_contiguous()
    assert _rows_view_ok(k_new) and _rows_view_ok(v_new) and src.shape == dst.shape
    kv_heads, head_dim = k_rows.shape[1], head_dim_of(k_rows)
    assert k_new.shape[1:] == (kv_heads, head_dim)
    if is_fp8(k_rows) and dst.numel():
        assert k_rows.shape[2] == packed(head_dim) and is_fp8(v_rows)
        launch(_store_kv_fp8_kernel, (dst.numel(),), k_new, v_new, k_rows, v_rows, src, dst,
               k_new.stride(0), v_new.stride(0), KVH=kv_heads,
               BLOCK_H=next_power_of_2(kv_heads), D=head_dim)
        return
    row = k_rows.shape[1] * k_rows.shape[2]
    if dst.numel():
        launch(_store_kv_kernel, (dst.numel(),), k_new, v_new, k_rows, v_rows, src, dst,
               k_new.stride(0), v_new.stride(0), ROW=row, BLOCK=next_power_of_2(row))
