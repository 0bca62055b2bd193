"""The CPU backend: the torch reference, except where a decode step's fixed costs dominate.
Projections over packed weights read int8 codes, and float32 norms, QK-norm + RoPE and decode
attention of a few rows run in compiled C (`muser.ops.native`; each has its spec in `ref`);
decode attention reads cached keys in place, and a few new KV rows are stored by copy."""

from __future__ import annotations

import torch

from muser.attention.dense_ref import attention_decode
from muser.ops import native, ref
from muser.ops.packed import PackedMatrix
from muser.ops.ref import embed, geglu, prefill_attention, rope_cos_sin, stage_gather


def linear(x: torch.Tensor, weight: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """x: [N, K] -> [N, M] float32. Up to native.MAX_ROWS rows (decode) on a packed weight
    read its codes; wider chunks run the float32 GEMM on its dense twin, or, where none is
    kept (the LM head), read the codes MAX_ROWS rows at a time."""
    if isinstance(weight, PackedMatrix):
        if x.shape[0] <= native.MAX_ROWS:
            return native.qgemv(x, weight)
        if weight.dense is None:
            return torch.cat([native.qgemv(part, weight) for part in x.split(native.MAX_ROWS)])
        weight = weight.dense
    return ref.linear(x, weight)


def linear_geglu(x: torch.Tensor, weight: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """ref.linear_geglu."""
    return geglu(linear(x, weight))


def _native_rows(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Decode-width float32 rows, and the C kernels are here."""
    return (x.shape[0] <= native.MAX_ROWS and x.dtype == dtype == torch.float32
            and native.available())


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if x.dim() == 2 and _native_rows(x, dtype):
        return native.rms_norm(x, weight, eps)
    return ref.rms_norm(x, weight, eps, dtype)


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, post_weight: torch.Tensor,
    next_weight: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_rows(x, dtype) and residual.dtype == torch.float32:
        return native.add_rms_norm(residual, x, post_weight, next_weight, eps)
    return ref.add_rms_norm(residual, x, post_weight, next_weight, eps, dtype)


def linear_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | PackedMatrix, residual: torch.Tensor,
    post_weight: torch.Tensor, next_weight: torch.Tensor, eps: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ref.linear_add_rms_norm."""
    return add_rms_norm(residual, linear(x, weight), post_weight, next_weight, eps, dtype)


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    if _native_rows(x):
        return native.qk_norm_rope(x, weight, cos, sin, eps)
    return ref.qk_norm_rope(x, weight, cos, sin, eps)


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
        ref.store_kv(k_rows, v_rows, k_out, v, torch.arange(dst.shape[0]), dst)
    return q_out, k_out


def store_kv(
    k_rows: torch.Tensor, v_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    src: torch.Tensor, dst: torch.Tensor,
) -> None:
    """ref.store_kv; a decode step's few rows are copied one by one (masked index_put costs
    ~60 us per call at this width)."""
    if src.numel() > native.MAX_ROWS:
        return ref.store_kv(k_rows, v_rows, k_new, v_new, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        if d >= 0:
            k_rows[d].copy_(k_new[s])
            v_rows[d].copy_(v_new[s])
    return None


def physical_runs(
    table: list[int], start: int, length: int, origin: int, block_size: int
) -> list[tuple[int, int]]:
    """Flat physical row ranges [a, b) holding logical keys [start, length) of one sequence, in
    logical order, adjacent ranges merged (ref.decode_rows, as ranges instead of rows)."""
    total = block_size * len(table)
    runs: list[list[int]] = []
    i = start
    while i < length:
        j = (origin + i) % total
        n = min(block_size - j % block_size, length - i)
        row = table[j // block_size] * block_size + j % block_size
        if runs and runs[-1][1] == row:
            runs[-1][1] += n
        else:
            runs.append([row, row + n])
        i += n
    return [(a, b) for a, b in runs]


def decode_attention(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, block_table: torch.Tensor,
    starts: torch.Tensor, lens: torch.Tensor, origins: torch.Tensor, block_size: int,
    scale: float, new: tuple | None = None,
) -> torch.Tensor:
    """ref.decode_attention reading each sequence's keys in place: one slice of the store when
    they are physically contiguous in some order (a ring, wrapped or not, or consecutive
    pages). One query sees every given key, so the order only moves float rounding. A float32
    cache is attended in C (`native.decode_attention`)."""
    if new is not None:
        store_kv(k_rows, v_rows, *new)
    out = torch.zeros(q.shape, dtype=torch.float32)
    meta = zip(block_table.tolist(), starts.tolist(), lens.tolist(), origins.tolist())
    for b, (table, start, length, origin) in enumerate(meta):
        if length <= start:
            continue
        runs = physical_runs(table, start, length, origin, block_size)
        if len(runs) == 2 and runs[1][1] == runs[0][0]:  # a wrapped ring: [a2, b1) in place
            runs = [(runs[1][0], runs[0][1])]
        if len(runs) == 1:
            k, v = k_rows[runs[0][0] : runs[0][1]], v_rows[runs[0][0] : runs[0][1]]
        else:
            k = torch.cat([k_rows[a:e] for a, e in runs])
            v = torch.cat([v_rows[a:e] for a, e in runs])
        if k.dtype == torch.float32 and k.stride() == v.stride() and native.available():
            out[b] = native.decode_attention(q[b].float(), k, v, scale)
        else:
            out[b] = attention_decode(q[b], k, v, scale)
    return out


__all__ = [
    "add_rms_norm", "decode_attention", "embed", "geglu", "linear", "linear_add_rms_norm",
    "linear_geglu", "prefill_attention", "qk_norm_rope", "qk_norm_rope_pair", "rms_norm",
    "rope_cos_sin", "stage_gather", "store_kv",
]
