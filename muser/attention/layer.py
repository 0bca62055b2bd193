"""Attention for one layer: store first, run the planned route, commit staged rows last."""

from __future__ import annotations

from types import ModuleType

import torch

from muser.attention.decode_meta import DecodeMeta
from muser.attention.dense_ref import attention_decode, attention_dense
from muser.attention.dispatch import attend_ops
from muser.attention.flash_ref import attention_tiled
from muser.attention.plan import SeqPlan
from muser.attention.routes import Route
from muser.ops import ref


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plans: list[SeqPlan],
    window: int | None,
    scale: float,
    tile: int,
    ops: ModuleType = ref,
    decode: DecodeMeta | None = None,
) -> torch.Tensor:
    """q: [N, H, D], k/v: [N, KVH, D] new rows; caches: [blocks, rows, KVH, D] -> [N, H, D] f32.

    With batched decode metadata, or a kernel backend, the routes run through `ops`
    (attention/dispatch.py); the loop below is the reference path."""
    if decode is not None or ops is not ref:
        return attend_ops(q, k, v, k_cache, v_cache, plans, window, scale, tile, ops, decode)
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for p in plans:
        kn, vn = k[p.rows].to(k_cache.dtype), v[p.rows].to(v_cache.dtype)
        if not p.staging:
            _store(k_rows, v_rows, kn, vn, p)
        keys, values = k_rows[p.read_rows], v_rows[p.read_rows]
        if p.staging:  # NOTE: a detached shadow in logical order; the live ring is untouched.
            keys, values = torch.cat((keys, kn)), torch.cat((values, vn))
        out[p.rows] = _run(p, q[p.rows], keys, values, window, scale, tile)
        if p.staging:
            _store(k_rows, v_rows, kn, vn, p)
    return out


def _store(k_rows: torch.Tensor, v_rows: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor,
           p: SeqPlan) -> None:
    k_rows[p.write_dst] = kn[p.write_src]
    v_rows[p.write_dst] = vn[p.write_src]


def _run(
    p: SeqPlan,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    window: int | None,
    scale: float,
    tile: int,
) -> torch.Tensor:
    if p.inner == Route.DECODE:
        return attention_decode(q[0], keys, values, scale)[None]
    if p.inner == Route.SHORT_CHUNK:
        return torch.stack([
            attention_decode(q[i], *_visible(keys, values, p, p.q_start + i, window), scale)
            for i in range(q.shape[0])
        ])
    if p.inner == Route.TILED:
        return attention_tiled(q, keys, values, p.q_start, p.k_start, window, scale, p.tiles,
                               tile, tile)
    q_pos = torch.arange(p.q_start, p.q_start + q.shape[0])
    k_pos = torch.arange(p.k_start, p.k_start + keys.shape[0])
    return attention_dense(q, keys, values, q_pos, k_pos, window, scale)


def _visible(keys: torch.Tensor, values: torch.Tensor, p: SeqPlan, pos: int,
             window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact key prefix row `pos` sees, as a decode step at `pos` would."""
    first = 0 if window is None else max(0, pos - window + 1 - p.k_start)
    last = pos - p.k_start + 1
    return keys[first:last], values[first:last]
