"""The CPU backend: the torch reference, except decode projections over packed weights, which
read int8 codes through the compiled kernel (`muser.ops.native`)."""

from __future__ import annotations

import torch

from muser.ops import native, ref
from muser.ops.packed import PackedMatrix
from muser.ops.ref import (
    add_rms_norm, decode_attention, geglu, prefill_attention, qk_norm_rope, qk_norm_rope_pair,
    rms_norm, rope_cos_sin, stage_gather, store_kv,
)


def linear(x: torch.Tensor, weight: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """x: [N, K] -> [N, M] float32. Up to native.MAX_ROWS rows (decode) on a packed weight
    read its codes; wider chunks run the float32 GEMM on its dense twin."""
    if isinstance(weight, PackedMatrix):
        if x.shape[0] <= native.MAX_ROWS:
            return native.qgemv(x, weight)
        weight = weight.dense
    return ref.linear(x, weight)


def geglu_linear(gate_up: torch.Tensor, weight: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """linear(geglu(gate_up), weight)."""
    return linear(geglu(gate_up), weight)


__all__ = [
    "add_rms_norm", "decode_attention", "geglu", "geglu_linear", "linear", "prefill_attention",
    "qk_norm_rope", "qk_norm_rope_pair", "rms_norm", "rope_cos_sin", "stage_gather", "store_kv",
]
