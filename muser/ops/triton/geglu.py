"""GeGLU: gelu_tanh(gate) * up over gate_up [N, 2I] (gate first), one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muser.ops.triton.alloc import empty
from muser.ops.triton.gemv import gelu_tanh
from muser.ops.triton.launch import cdiv, launch
from muser.ops.triton.pdl import enter, options


@triton.jit
def _geglu_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = gelu_tanh(gate) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2 * I] -> [N, I]; in gate_up's dtype when it is 16-bit (its only consumer,
    the down projection, rounds to that dtype anyway), else float32."""
    n, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(-1) == 1
    i = two_i // 2
    dtype = gate_up.dtype if gate_up.element_size() == 2 else torch.float32
    out = empty((n, i), dtype, gate_up.device)
    block = 1024
    launch(_geglu_kernel, (n, cdiv(i, block)), gate_up, out, i, gate_up.stride(0),
           out.stride(0), BLOCK=block, **options(gate_up.device))
    return out
