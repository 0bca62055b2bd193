"""Projections: the decode GEMV for a few rows, cuBLAS tensor-core GEMM for prefill chunks.

Outputs are in the weight dtype: the same values as the reference (which rounds the product
to the weight dtype and then upcasts); every consumer upcasts on load.
MUSER_GEMV=0 routes decode rows to cuBLAS too (for comparing the two).
"""

from __future__ import annotations

import os

import torch

from muser.ops.triton.geglu import geglu
from muser.ops.triton.gemv import MAX_ROWS, gemv


def _use_gemv(num_rows: int) -> bool:
    return num_rows <= MAX_ROWS and os.environ.get("MUSER_GEMV", "1") != "0"


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [N, K], weight: [M, K] -> [N, M] in weight.dtype."""
    if _use_gemv(x.shape[0]):
        return gemv(x, weight)
    return torch.mm(x.to(weight.dtype), weight.t())


def geglu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(geglu(gate_up), weight); decode rows fuse the GeGLU into the GEMV's input load."""
    if _use_gemv(gate_up.shape[0]):
        return gemv(gate_up, weight, geglu=True)
    return linear(geglu(gate_up), weight)
