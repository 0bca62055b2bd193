"""RMSNorm, and RMSNorm fused with the residual add: one row per program, one pass. The pair
can also quantize its output rows to e4m3 for the FP8 projection after it
(`fp8.quantize_activations` of the output, bit for bit, with no kernel of its own)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.fp8 import FP8, Fp8Matrix, attach_rows
from muser.ops.triton.alloc import empty
from muser.ops.triton.launch import launch, next_power_of_2
from muser.ops.triton.pdl import enter, options
from muser.ops.triton.quantize_fp8 import activation_scale, e4m3_codes


@triton.jit
def _add_rms_norm_kernel(
    res_ptr, x_ptr, post_ptr, next_ptr, res_out_ptr, out_ptr, codes_ptr, scales_ptr, D,
    stride_res, stride_x, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    # NOTE: the weights are no earlier kernel's output: loaded before the wait (pdl.py)
    w = tl.load(next_ptr + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        post = tl.load(post_ptr + d, mask=mask, other=0.0).to(tl.float32)
    enter(PDL)
    x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + d, mask=mask, other=0.0).to(tl.float32)
        x = r + x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * post
        tl.store(res_out_ptr + row * D + d, x, mask=mask)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D + d, y, mask=mask)
    if QUANTIZE:  # quantize_activations of the stored values (masked lanes are 0)
        y = y.to(tl.float32)
        scale, inverse = activation_scale(tl.max(tl.abs(y), axis=0))
        tl.store(scales_ptr + row, scale)
        tl.store(codes_ptr + row * D + d, e4m3_codes(y, inverse, codes_ptr.dtype.element_ty),
                 mask=mask)


def _launch(residual, x, post, nxt, eps, dtype, fp8_rows=False):
    n, d = x.shape
    assert x.stride(-1) == 1 and nxt.shape == (d,)
    out = empty((n, d), dtype, x.device)
    res_out = empty(out.shape, torch.float32, out.device) if residual is not None else out
    codes, scales = (empty((n, d), FP8, x.device), empty((n,), torch.float32, x.device)) if (
        fp8_rows) else (out, out)
    block = next_power_of_2(d)
    warps = 4 if block <= 2048 else 8
    launch(
        _add_rms_norm_kernel, (n,), residual if residual is not None else x, x,
        post if post is not None else nxt, nxt, res_out, out, codes, scales, d,
        residual.stride(0) if residual is not None else 0, x.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK_D=block, QUANTIZE=fp8_rows, num_warps=warps,
        **options(x.device),
    )
    if fp8_rows:
        attach_rows(out, Fp8Matrix(codes, scales, dtype))
    return res_out, out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x: [..., D] -> same shape, in `dtype`."""
    shape = x.shape
    return _launch(None, x.reshape(-1, shape[-1]), None, weight, eps, dtype)[1].view(shape)


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, post_weight: torch.Tensor,
    next_weight: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32,
    fp8_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual [N, D] f32 + rms_norm(x, post) -> (new residual f32, rms_norm(it, next) in
    `dtype`); fp8_rows: the second also carries its rows quantized (`fp8.attach_rows`)."""
    assert residual.stride(-1) == 1 and residual.shape == x.shape
    return _launch(residual, x, post_weight, next_weight, eps, dtype, fp8_rows)
