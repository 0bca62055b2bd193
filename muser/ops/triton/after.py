"""The op after a projection — GeGLU, or the residual add + RMSNorm pair — as its own kernel,
where the projection's kernel does not fuse it (linear.py, linear_fp8.py, block_weights.py)."""

from __future__ import annotations

import torch

from muser.ops.triton.geglu import geglu
from muser.ops.triton.gemv import NormEpilogue
from muser.ops.triton.norm import add_rms_norm


def after(y: torch.Tensor, geglu_out: bool, norm: NormEpilogue | None):
    """geglu(y), add_rms_norm(norm's residual, y, ...) or y."""
    if geglu_out:
        return geglu(y)
    if norm is not None:
        return add_rms_norm(norm.residual, y, norm.post, norm.next, norm.eps, norm.dtype)
    return y
