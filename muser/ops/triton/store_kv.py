"""Store first: copy new K/V rows into a layer's cache rows (cast to the cache dtype)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def _rows_view_ok(t: torch.Tensor) -> bool:
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def store_kv(
    k_rows: torch.Tensor, v_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    src: torch.Tensor, dst: torch.Tensor,
) -> None:
    """k_rows[dst[i]] = k_new[src[i]] (and v); k/v_rows: [R, KVH, D] contiguous;
    k/v_new: [N, KVH, D] with contiguous rows; src/dst: [W] int on the device; dst < 0 skips."""
    assert k_rows.is_contiguous() and v_rows.is_contiguous()
    assert _rows_view_ok(k_new) and _rows_view_ok(v_new) and src.shape == dst.shape
    row = k_rows.shape[1] * k_rows.shape[2]
    if dst.numel():
        launch(_store_kv_kernel, (dst.numel(),), k_new, v_new, k_rows, v_rows, src, dst,
               k_new.stride(0), v_new.stride(0), ROW=row, BLOCK=next_power_of_2(row))
