"""GeGLU: gelu_tanh(gate) * up over gate_up [N, 2I] (gate first), one pass; optionally with
its rows quantized to e4m3 for the FP8 projection after it (the kernel stores each block's
largest |output| as it goes, the first of quantize_fp8's two kernels)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.fp8 import attach_rows
from muser.ops.triton.alloc import empty
from muser.ops.triton.gemv import gelu_tanh
from muser.ops.triton.launch import cdiv, launch
from muser.ops.triton.pdl import enter, options
from muser.ops.triton.quantize_fp8 import launch_rule, quantize_rows_fp8


@triton.jit
def _geglu_kernel(x_ptr, out_ptr, amax_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr,
                  AMAX: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = (gelu_tanh(gate) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if AMAX:  # masked lanes hold gelu(0) * 0 = 0
        tl.store(amax_ptr + row * tl.num_programs(1) + blk,
                 tl.max(tl.abs(y.to(tl.float32)), axis=0))


def geglu(gate_up: torch.Tensor, fp8_rows: bool = False) -> torch.Tensor:
    """gate_up: [N, 2 * I] -> [N, I]; in gate_up's dtype when it is 16-bit (its only consumer,
    the down projection, rounds to that dtype anyway), else float32. fp8_rows: the output also
    carries its rows quantized (`fp8.attach_rows`)."""
    n, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(-1) == 1
    i = two_i // 2
    dtype = gate_up.dtype if gate_up.element_size() == 2 else torch.float32
    out = empty((n, i), dtype, gate_up.device)
    block = launch_rule(i)[0]  # the quantization's blocks
    amax = empty((n, cdiv(i, block)), torch.float32, gate_up.device) if fp8_rows else out
    launch(_geglu_kernel, (n, cdiv(i, block)), gate_up, out, amax, i, gate_up.stride(0),
           out.stride(0), BLOCK=block, AMAX=fp8_rows, **options(gate_up.device))
    if fp8_rows:
        attach_rows(out, quantize_rows_fp8(out, block_amax=amax))
    return out
