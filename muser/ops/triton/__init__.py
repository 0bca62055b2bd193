"""Triton twins of every op in `muser.ops.ref`, same names and signatures (GPU backend).

Only this package imports triton; model code reaches it through `muser.ops.backend`.
"""

from __future__ import annotations

from muser.ops.triton import (
    linear_fp8,  # noqa: F401  (routes Fp8Matrix projections)
    tuning,  # the warm-up's view of this backend
)
from muser.ops.triton.block_weights import embed, prepare_weights
from muser.ops.triton.decode_attention import decode_attention, decode_norm_rope
from muser.ops.triton.geglu import geglu
from muser.ops.triton.linear import linear, linear_add_rms_norm, linear_geglu, width_inexact
from muser.ops.triton.norm import add_rms_norm, rms_norm
from muser.ops.triton.prefill_attention import prefill_attention
from muser.ops.triton.qk_norm_rope import qk_norm_rope, qk_norm_rope_pair
from muser.ops.triton.rope import rope_cos_sin
from muser.ops.triton.stage_gather import stage_gather
from muser.ops.triton.store_kv import store_kv

__all__ = [
    "add_rms_norm", "decode_attention", "decode_norm_rope", "embed", "geglu", "linear", "linear_add_rms_norm",
    "linear_geglu", "prefill_attention", "prepare_weights", "qk_norm_rope", "qk_norm_rope_pair",
    "rms_norm", "rope_cos_sin", "stage_gather", "store_kv", "tuning", "width_inexact",
]
