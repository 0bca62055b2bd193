"""Staging-shadow gather: cache rows (logical order) then the chunk's new rows, into one
detached contiguous buffer. With no new rows it is the plain gather of a chunk's key range. An
FP8 cache's rows are copied as bytes and the new rows quantized as store_kv stores them, so the
shadow holds what the cache will (muser/ops/kv_fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.kv_fp8 import head_dim_of, is_fp8
from muser.ops.triton.alloc import empty
from muser.ops.triton.kv_fp8 import quantize_heads, store_heads
from muser.ops.triton.launch import launch, next_power_of_2


# NOTE: the row count and the rows' offset in the step's metadata vary from one forward to the next;
# left unspecialized, they need no compile the warm-up did not do (muser/startup/warmup.py)
@triton.jit(do_not_specialize=["num_read"], do_not_specialize_on_alignment=["read_ptr"])
def _stage_gather_kernel(k_rows, v_rows, read_ptr, k_new, v_new, k_out, v_out, num_read,
                         stride_kn, stride_vn, ROW: tl.constexpr, BLOCK: tl.constexpr,
                         FP8: tl.constexpr, KVH: tl.constexpr, BLOCK_H: tl.constexpr,
                         D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    mask = e < ROW
    if i < num_read:
        row = tl.load(read_ptr + i).to(tl.int64)
        k = tl.load(k_rows + row * ROW + e, mask=mask).to(k_out.dtype.element_ty)
        v = tl.load(v_rows + row * ROW + e, mask=mask).to(v_out.dtype.element_ty)
        tl.store(k_out + i * ROW + e, k, mask=mask)
        tl.store(v_out + i * ROW + e, v, mask=mask)
    elif FP8:  # a new row: each KV head quantized into its packed row (ROW = KVH * (D + 4))
        j = i - num_read
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        heads = h < KVH
        at = i * ROW + h.to(tl.int64) * (D + 4)
        kx = tl.load(k_new + j * stride_kn + h[:, None] * D + d[None, :], mask=heads[:, None])
        codes, scale, _ = quantize_heads(kx.to(tl.float32))
        store_heads(k_out, at, d, codes, scale, heads, D)
        vx = tl.load(v_new + j * stride_vn + h[:, None] * D + d[None, :], mask=heads[:, None])
        codes, scale, _ = quantize_heads(vx.to(tl.float32))
        store_heads(v_out, at, d, codes, scale, heads, D)
    else:
        j = i - num_read
        k = tl.load(k_new + j * stride_kn + e, mask=mask).to(k_out.dtype.element_ty)
        v = tl.load(v_new + j * stride_vn + e, mask=mask).to(v_out.dtype.element_ty)
        tl.store(k_out + i * ROW + e, k, mask=mask)
        tl.store(v_out + i * ROW + e, v, mask=mask)


def stage_gather(
    k_rows: torch.Tensor, v_rows: torch.Tensor, read_rows: torch.Tensor,
    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v_rows: [R, KVH, D] store (FP8: packed [R, KVH, D + 4]); read_rows: [S] device ints;
    k/v_new: [T, KVH, D] rows with a unit inner layout, or None -> ([S + T, KVH, D], same)
    contiguous, in the cache's dtype and form."""
    assert k_rows.is_contiguous() and v_rows.is_contiguous()
    num_read = read_rows.numel()
    num_new = 0 if k_new is None else k_new.shape[0]
    if k_new is None:
        k_new, v_new = k_rows, v_rows
    assert k_new.stride(2) == 1 and k_new.stride(1) == k_new.shape[2]
    assert v_new.stride(2) == 1 and v_new.stride(1) == v_new.shape[2]
    kv_heads, head_dim, fp8 = k_rows.shape[1], head_dim_of(k_rows), is_fp8(k_rows)
    assert not num_new or k_new.shape[1:] == (kv_heads, head_dim)
    shape = (num_read + num_new, *k_rows.shape[1:])
    k_out = empty(shape, k_rows.dtype, k_rows.device)
    v_out = empty(shape, v_rows.dtype, v_rows.device)
    row = k_rows.shape[1] * k_rows.shape[2]
    if shape[0]:
        launch(_stage_gather_kernel, (shape[0],), k_rows, v_rows, read_rows, k_new, v_new,
               k_out, v_out, num_read, k_new.stride(0), v_new.stride(0), ROW=row,
               BLOCK=next_power_of_2(row), FP8=fp8, KVH=kv_heads,
               BLOCK_H=next_power_of_2(kv_heads), D=head_dim)
    return k_out, v_out
