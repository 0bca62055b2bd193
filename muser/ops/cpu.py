"""The CPU backend: muser's own C kernels at every width (`muser.ops.native`), so each output
is reduced in one order whether a step carries 1 row or 512 — a prompt gives the same logits
and K/V bits prefilled in one chunk, in chunks of any width, or token by token, alone or in
a batch. Projections read packed matrices (GGUF codes, or values; `muser.ops.packed`);
attention visits each query's keys by distance from it, wherever they are stored. What stays
in torch moves data or is one IEEE operation per element (embedding lookup, scaling, casts,
cache stores). Each op has its spec in `muser.ops.ref`."""

from __future__ import annotations

import dataclasses
import functools

import torch

import muser.ops.native as c_kernels
from muser.ops.kv_fp8 import is_fp8
from muser.ops.packed import PackedMatrix
from muser.ops.ref import (
    Weights,
    decode_norm_rope,
    embed,
    inv_freq,
    stage_gather,
    width_inexact,
    with_norm_rope,
)
from muser.ops.ref import store_kv as reference_store_kv

FEW_ROWS = 8  # stores of at most this many rows are copied row by row (index_put is slower)


def prepare_weights(weights: Weights) -> Weights:
    """Every matrix in the kernels' panel layout (codes stay codes); builds the C kernels
    first, so a machine without a compiler fails here with one clear line."""
    c_kernels.library()

    def pack(m: torch.Tensor | PackedMatrix | None) -> PackedMatrix | None:
        if m is None or isinstance(m, PackedMatrix):
            return m
        return PackedMatrix.from_dense(m.cpu())

    def pack_moe(moe):  # a layer's routed experts (muser.graph.weights.MoeWeights), or None
        if moe is None:
            return None
        return dataclasses.replace(moe, router=pack(moe.router),
                                   gate_up=[pack(m) for m in moe.gate_up],
                                   down=[pack(m) for m in moe.down])

    matrices = ("qkv", "o_proj", "gate_up", "down", "per_layer_gate", "per_layer_proj")
    layers = [dataclasses.replace(layer, moe=pack_moe(layer.moe),
                                  **{f: pack(getattr(layer, f)) for f in matrices})
              for layer in weights.layers]
    return dataclasses.replace(weights, embed=pack(weights.embed), layers=layers,
                               lm_head=pack(weights.lm_head),
                               per_layer_model_proj=pack(weights.per_layer_model_proj))


def _weight(weight: torch.Tensor | PackedMatrix) -> PackedMatrix:
    if not isinstance(weight, PackedMatrix):
        raise TypeError("CPU weights must be packed first (muser.ops.cpu.prepare_weights)")
    return weight


def linear(x: torch.Tensor, weight: PackedMatrix) -> torch.Tensor:
    """x: [N, K] (float32, or values of the weights' 16-bit dtype) -> [N, M] float32."""
    return c_kernels.gemm(x.float(), _weight(weight))


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    return c_kernels.geglu(gate_up.float())


def linear_geglu(x: torch.Tensor, weight: PackedMatrix) -> torch.Tensor:
    """ref.linear_geglu."""
    return geglu(linear(x, weight))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """ref.rms_norm of [N, D] rows; computed in float32, then rounded to `dtype`."""
    return c_kernels.rms_norm(x.float(), weight.float(), eps).to(dtype)


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, post_weight: torch.Tensor,
    next_weight: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ref.add_rms_norm."""
    h, y = c_kernels.add_rms_norm(residual.float(), x.float(), post_weight.float(),
                               next_weight.float(), eps)
    return h, y.to(dtype)


def linear_add_rms_norm(
    x: torch.Tensor, weight: PackedMatrix, residual: torch.Tensor,
    post_weight: torch.Tensor, next_weight: torch.Tensor, eps: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ref.linear_add_rms_norm."""
    return add_rms_norm(residual, linear(x, weight), post_weight, next_weight, eps, dtype)


@functools.cache
def _inv_freq(head_dim: int, theta: float, scaling: float, fraction: float) -> torch.Tensor:
    """ref.inv_freq, once per layer kind."""
    return inv_freq(head_dim, theta, scaling, fraction)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: float = 1.0,
    fraction: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ref.rope_cos_sin, each position's row computed on its own."""
    return c_kernels.rope_cos_sin(positions, _inv_freq(head_dim, theta, scaling, fraction))


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    return c_kernels.qk_norm_rope(x.float(), weight.float(), cos, sin, eps)


def qk_norm_rope_pair(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, k_dtype: torch.dtype = torch.float32,
    store: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ref.qk_norm_rope_pair."""
    q_out = qk_norm_rope(q, q_weight, cos, sin, eps)
    k_out = qk_norm_rope(k, k_weight, cos, sin, eps).to(k_dtype)
    if store is not None:
        k_rows, v_rows, v, dst = store
        store_kv(k_rows, v_rows, k_out, v, torch.arange(dst.shape[0]), dst)
    return q_out, k_out


def store_kv(
    k_rows: torch.Tensor, v_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    src: torch.Tensor, dst: torch.Tensor,
) -> None:
    """ref.store_kv; a decode step's few rows are copied one by one."""
    if src.numel() > FEW_ROWS:
        return reference_store_kv(k_rows, v_rows, k_new, v_new, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        if d >= 0:
            k_rows[d].copy_(k_new[s])
            v_rows[d].copy_(v_new[s])
    return None


def decode_attention(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, block_table: torch.Tensor,
    starts: torch.Tensor, lens: torch.Tensor, origins: torch.Tensor, block_size: int,
    scale: float, new: tuple | None = None, norm_rope: tuple | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """ref.decode_attention: the new rows stored first, then each sequence's query over its
    keys [start, len), read in place through the block table (a 16-bit cache widened exactly
    as the kernel reads it). `dtype` is unused: this backend refuses FP8 caches (EngineConfig)."""
    assert not is_fp8(k_rows), "FP8 KV caches are refused on the CPU backend"
    if norm_rope is not None:
        q, new = with_norm_rope(q, new, norm_rope, k_rows.dtype, qk_norm_rope_pair)
    if new is not None:
        store_kv(k_rows, v_rows, *new)
    return c_kernels.decode_attention(q.float(), k_rows, v_rows, block_table, starts, lens,
                                   origins, block_size, scale)


def prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int, k_start: int,
    window: int | None, scale: float, tiles: torch.Tensor | None, tile: int, route,
    tile_ranges: torch.Tensor | None = None, read_rows: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """ref.prefill_attention, by one kernel for every route: each query row over exactly its
    visible keys, visited by distance (so the route, the tiles and where the keys came from
    do not change a bit). `dtype` is unused: this backend refuses FP8 caches (EngineConfig)."""
    assert not is_fp8(keys), "FP8 KV caches are refused on the CPU backend"
    if read_rows is not None:
        keys, values = stage_gather(keys, values, read_rows)
    if keys.dtype != values.dtype or keys.dtype not in c_kernels.FORMATS:
        keys, values = keys.float(), values.float()  # a 16-bit cache goes in as it is
    if keys.stride() != values.stride():
        # NOTE: not .contiguous(): torch calls a tensor with one row contiguous whatever its
        # row stride, and the kernel takes one set of strides for keys and values
        keys, values = _packed(keys), _packed(values)
    return c_kernels.attention(q.float(), keys, values, q_start - k_start, 0, window, scale)


def _packed(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with row-major strides."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


__all__ = [
    "add_rms_norm", "decode_attention", "decode_norm_rope", "embed", "geglu", "linear",
    "linear_add_rms_norm", "linear_geglu", "prefill_attention", "prepare_weights", "qk_norm_rope",
    "qk_norm_rope_pair", "rms_norm", "rope_cos_sin", "stage_gather", "store_kv", "width_inexact",
]
