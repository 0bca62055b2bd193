"""The specification of every op, in plain PyTorch: the CPU path and the test oracle.

Each function here has a twin with the same signature under `muser/ops/triton/`.
Activations on the residual stream are float32; projections take the weight's dtype.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F

from muser.ops.blocks import BlockMatrix
from muser.ops.dense_ref import attention_decode, attention_dense
from muser.ops.flash_ref import attention_tiled
from muser.ops.fp8 import Fp8Matrix
from muser.ops.kv_fp8 import is_fp8, to_store
from muser.ops.kv_fp8 import values as kv_values
from muser.ops.packed import PackedMatrix, dense
from muser.ops.routes import Route

Weights = TypeVar("Weights")  # muser.graph.weights.ModelWeights (ops/ imports no graph/)


def _up(x: torch.Tensor) -> torch.Tensor:
    """float32, except float64 stays float64 (tests run the spec in float64)."""
    return x if x.dtype == torch.float64 else x.float()


def prepare_weights(weights: Weights) -> Weights:
    """The weights as this backend reads them: as given (packed ones are dequantized per use)."""
    return weights


def embed(table: torch.Tensor | PackedMatrix | Fp8Matrix, ids: torch.Tensor, scale: float = 1.0,
          feed: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` of the embedding table times `scale` -> [N, D] float32 (a packed or FP8 table
    dequantizes only those rows). feed: where an id is negative, the row takes feed's id (a
    decode step queued before the host knows its tokens)."""
    ids = fed(ids, feed)
    if isinstance(table, PackedMatrix):
        rows = table.dequantize(ids)
    elif isinstance(table, Fp8Matrix):  # a tied FP8 head: the rows' codes times their scales
        rows = table.dequantize(rows=ids)
    else:
        rows = table[ids].float()
    return rows if scale == 1.0 else rows * scale


def fed(ids: torch.Tensor, feed: torch.Tensor | None) -> torch.Tensor:
    """ids with each negative one replaced by feed's id of the same row (feed None: ids)."""
    if feed is None:
        return ids
    return torch.where(ids < 0, feed[:ids.shape[0]].to(ids.dtype), ids)


def linear(x: torch.Tensor, weight: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """x: [N, K] float32, weight: [M, K] -> [N, M] float32; the product runs in weight.dtype
    (a packed weight is dequantized first)."""
    weight = dense(weight)
    x = x.to(weight.dtype)
    if x.shape[0] == 1 and x.device.type == "cpu":
        # NOTE: CPU GEMM picks a GEMV path for one row whose K-reduction order differs (seen at
        # K=2048); two rows take the GEMM path every wider batch takes, so a row's bits do not
        # depend on how many sequences share the decode step.
        return _up(F.linear(x.expand(2, -1), weight)[:1])
    return _up(F.linear(x, weight))


def dequantize_blocks(weight: BlockMatrix, dtype: torch.dtype) -> torch.Tensor:
    """weight: an [M, K] matrix as GGUF blocks -> [M, K] in `dtype`: gguf's float32 values,
    rounded once."""
    return weight.dequantize().to(dtype)


def linear_blocks(x: torch.Tensor, weight: BlockMatrix) -> torch.Tensor:
    """x: [N, K] float32, weight: an [M, K] matrix as GGUF blocks -> [N, M] float32: x times
    the blocks' float32 values."""
    return _up(F.linear(x, weight.dequantize().to(x.dtype)))


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x: [N, K] float -> (hi, lo, scale, sums, half_sums): x as two int8 levels per group of
    32 values, the block GEMV's input on the GPU (muser/ops/triton/int8_rows.py defines it)."""
    n, k = x.shape
    g = x.float().reshape(n, k // 32, 32)
    a = g.abs().amax(-1)
    e = ((a.view(torch.int32) >> 23) & 0xFF).clamp(min=13) - 5
    t = g / (e << 23).view(torch.float32)[..., None]
    h = torch.round(t)  # half to even, as the kernel's rint
    low = torch.round((t - h) * 128)
    words = [v.to(torch.int8).reshape(n, k).view(torch.int32) for v in (h, low)]
    # half sums per 256 values: a last partial 256 as if zeros followed (they sum to 0)
    full = F.pad((128 * h + low).reshape(n, k), (0, -k % 256))
    halves = full.reshape(n, -1, 8, 2, 16).sum(-1).to(torch.int32)
    return (words[0], words[1], ((e - 7) << 23).view(torch.float32),
            halves.sum(-1, dtype=torch.int32).reshape(n, -1)[:, :k // 32],
            halves.transpose(2, 3).reshape(n, -1))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x: [..., D] -> same shape in `dtype` (the next projection's input dtype; the norm
    computes in float32). Gemma's (1 + w) is already folded into `weight`."""
    x = _up(x)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * _up(weight)
    return y if x.dtype == torch.float64 else y.to(dtype)


def add_rms_norm(
    residual: torch.Tensor,
    x: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + rms_norm(x, post) -> (new residual [N, D] f32, rms_norm(it, next) in
    `dtype`)."""
    residual = residual + rms_norm(x, post_weight, eps)
    return residual, rms_norm(residual, next_weight, eps, dtype)


def inv_freq(head_dim: int, theta: float, scaling: float = 1.0, fraction: float = 1.0,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE's [head_dim // 2] frequencies, HF's arithmetic: theta ** (-2i / head_dim) / scaling
    for the first int(fraction * head_dim // 2) pairs, 0 for the rest (transformers'
    "proportional" RoPE: those pairs stay at angle 0, cos 1 and sin 0)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    freq = 1.0 / (theta ** (exponent / head_dim)) / scaling
    freq[int(fraction * head_dim // 2):] = 0.0
    return freq


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: float = 1.0,
    fraction: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [N] int -> (cos, sin): [N, head_dim // 2] float32 at inv_freq's angles."""
    freq = inv_freq(head_dim, theta, scaling, fraction, positions.device)
    angles = positions.float()[:, None] * freq[None, :]
    return angles.cos(), angles.sin()


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """x: [N, heads, head_dim] -> per-head RMSNorm then NeoX-style RoPE (rotate halves), f32."""
    x = rms_norm(x, weight, eps)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2 * I] (gate first) -> gelu_tanh(gate) * up: [N, I] float32."""
    gate, up = _up(gate_up).chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def linear_geglu(x: torch.Tensor, weight: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """geglu(linear(x, weight)): the MLP's gate_up projection and activation -> [N, M / 2]."""
    return geglu(linear(x, weight))


def linear_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | PackedMatrix, residual: torch.Tensor,
    post_weight: torch.Tensor, next_weight: torch.Tensor, eps: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection whose output joins the residual stream: add_rms_norm(residual,
    linear(x, weight), post_weight, next_weight, eps, dtype) -> (new residual, next input)."""
    return add_rms_norm(residual, linear(x, weight), post_weight, next_weight, eps, dtype)


def store_kv(
    k_rows: torch.Tensor, v_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    src: torch.Tensor, dst: torch.Tensor,
) -> None:
    """k_rows[dst[i]] = k_new[src[i]] (and v), cast to the cache dtype (an FP8 cache: quantized,
    muser/ops/kv_fp8.py); dst < 0 writes nothing.

    k_rows/v_rows: [num_rows, kv_heads, head_dim] flat physical rows of one layer's store
    ([num_rows, kv_heads, head_dim + 4] uint8 for FP8).
    """
    keep = dst >= 0
    src, dst = src[keep], dst[keep]
    k_rows[dst] = to_store(k_new[src], k_rows)
    v_rows[dst] = to_store(v_new[src], v_rows)


def stage_gather(
    k_rows: torch.Tensor, v_rows: torch.Tensor, read_rows: torch.Tensor,
    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous keys/values in logical order: rows `read_rows` of the store, then (staging
    shadow) the chunk's own new rows -> ([S, kv_heads, head_dim], same) in the cache's form
    (FP8: packed rows, the new ones quantized as store_kv stores them)."""
    keys, values = k_rows[read_rows], v_rows[read_rows]
    if k_new is not None:
        keys = torch.cat((keys, to_store(k_new, k_rows)))
        values = torch.cat((values, to_store(v_new, v_rows)))
    return keys, values


def decode_rows(
    block_table: torch.Tensor, start: int, length: int, origin: int, block_size: int
) -> torch.Tensor:
    """Flat physical rows of logical keys [start, length) of one sequence.

    key i lives at j = (origin + i) mod (block_size * blocks); row = table[j // bs] * bs + j % bs.
    A sliding ring is one block of `capacity` rows whose physical origin moves; a paged global
    cache is many blocks with origin 0 (the modulo never wraps).
    """
    j = (origin + torch.arange(start, length, device=block_table.device)) % (
        block_size * block_table.shape[0]
    )
    return block_table[j // block_size].long() * block_size + j % block_size


def decode_attention(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, block_table: torch.Tensor,
    starts: torch.Tensor, lens: torch.Tensor, origins: torch.Tensor, block_size: int,
    scale: float, new: tuple | None = None, norm_rope: tuple | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One query row per sequence over its cached keys. q: [B, H, D]; k/v_rows: flat physical
    rows [R, KVH, D] (FP8: packed, read dequantized; `dtype`, the Triton twin's dot dtype, is
    unused: this reference computes in float32); block_table: [B, blocks] int32; starts/lens/origins: [B] int32 ->
    [B, H, D] float32 (zeros where lens <= starts: padding rows).

    new = (k, v, src, dst): the step's new rows, stored first (store_kv); the row stored for
    sequence b is its newest key, logical lens[b] - 1. norm_rope: see with_norm_rope."""
    if norm_rope is not None:
        k_dtype = torch.float32 if is_fp8(k_rows) else k_rows.dtype
        q, new = with_norm_rope(q, new, norm_rope, k_dtype, qk_norm_rope_pair)
    if new is not None:
        store_kv(k_rows, v_rows, *new)

    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        start, length = int(starts[b]), int(lens[b])
        if length <= start:
            continue
        rows = decode_rows(block_table[b], start, length, int(origins[b]), block_size)
        out[b] = attention_decode(q[b], kv_values(k_rows[rows]), kv_values(v_rows[rows]), scale)
    return out


def width_inexact(matrices: list) -> str | None:
    """Why a row's bits may depend on how many rows its step runs (None: they do not, whatever
    the weights): here every op computes a row on its own."""
    return None


def decode_norm_rope() -> bool:
    """Whether decode attention may take the projection's raw rows and apply QK-norm + RoPE
    itself (`norm_rope`): here the same function as qk_norm_rope_pair, so yes."""
    return True


def with_norm_rope(
    q: torch.Tensor, new: tuple, norm_rope: tuple, k_dtype: torch.dtype, pair
) -> tuple[torch.Tensor, tuple]:
    """decode_attention's norm_rope = (q_weight, k_weight, cos, sin, eps): q [B, H, D] and the
    new keys k [B, KVH, D] are the projection's raw rows, one per sequence in order (src the
    identity, as the decode metadata makes it) -> (q, new) after QK-norm + RoPE by `pair` (a
    qk_norm_rope_pair; the keys in k_dtype), sequence b's key at its query's angle (cos/sin row
    b: the same token). Exactly the pair the layer runs otherwise, so on the CPU a decode step
    gives the same bits either way."""
    assert new is not None, "norm_rope applies to the step's own new rows"
    k, v, src, dst = new
    assert k.shape[0] == q.shape[0], "norm_rope: one new row per sequence, in order"
    q, k = pair(q, k, *norm_rope, k_dtype)
    return q, (k, v, src, dst)


def prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int, k_start: int,
    window: int | None, scale: float, tiles: torch.Tensor | None, tile: int, route,
    tile_ranges: torch.Tensor | None = None, read_rows: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A chunk's queries q: [T, H, D] at positions q_start.. over contiguous keys/values
    [S, KVH, D] at k_start.. (causal, windowed when `window`) -> [T, H, D] float32. With
    read_rows [S], keys/values are the layer's store and its rows read_rows the keys in order.
    FP8 keys/values (packed rows) are read dequantized (`dtype`: the Triton twin's dot dtype).

    The reference runs the chunk's route: SHORT_CHUNK (decode per row), TILED (classifier),
    DENSE or FALLBACK_F32 (masked dense). `tile_ranges` is only used by the Triton twin.
    """
    if read_rows is not None:
        keys, values = stage_gather(keys, values, read_rows)
    keys, values = kv_values(keys), kv_values(values)

    if route in (Route.SHORT_CHUNK, Route.DECODE):
        rows = []
        for i in range(q.shape[0]):
            pos = q_start + i
            first = 0 if window is None else max(0, pos - window + 1 - k_start)
            last = pos - k_start + 1
            rows.append(attention_decode(q[i], keys[first:last], values[first:last], scale))
        return torch.stack(rows)
    if route == Route.TILED:
        return attention_tiled(q, keys, values, q_start, k_start, window, scale, tiles, tile, tile)
    q_pos = torch.arange(q_start, q_start + q.shape[0], device=q.device)
    k_pos = torch.arange(k_start, k_start + keys.shape[0], device=q.device)
    return attention_dense(q, keys, values, q_pos, k_pos, window, scale)


def qk_norm_rope_pair(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, k_dtype: torch.dtype = torch.float32,
    store: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rope of the queries (f32) and of the keys (in k_dtype: the cache dtype, which
    they are stored in; float32 for an FP8 cache, whose codes round the float32 keys once);
    one launch on the GPU.

    store = (k_rows, v_rows, v, dst): also store row i's keys and values v[i] at flat cache
    row dst[i] (dst < 0: not stored). A prefill chunk written in place is stored here, before
    attention reads the cache (store first) and at no extra launch."""
    q_out = qk_norm_rope(q, q_weight, cos, sin, eps)
    k_out = qk_norm_rope(k, k_weight, cos, sin, eps).to(k_dtype)
    if store is not None:
        k_rows, v_rows, v, dst = store
        src = torch.arange(dst.shape[0], device=dst.device)
        store_kv(k_rows, v_rows, k_out, v, src, dst)
    return q_out, k_out
