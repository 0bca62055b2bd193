"""Attention for one layer through the ops layer (torch references on the CPU, Triton on CUDA).

    decode rows (the step's leading ... ops.decode_attention over all of them at once,
    one-row sequences)                  storing the new rows first (ring-aware;
                                        graph-capturable)
    prefill chunk, in place ........... rows already stored (by ops.qk_norm_rope_pair),
                                        ops.prefill_attention (the chunk's route) over
                                        the key range's rows in the cache, in place
    prefill chunk, STAGING ............ ops.stage_gather (ring tail + chunk: the detached
                                        shadow), ops.prefill_attention, then ops.store_kv

A chunk with nothing cached before it (its keys are exactly its own rows) attends its new
rows where they are, with no gather, when they are already in the cache dtype.
"""

from __future__ import annotations

from types import ModuleType

import torch

from muser.attention.decode_meta import DecodeMeta
from muser.attention.plan import SeqPlan
from muser.ops import ref


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    plans: list[SeqPlan],
    window: int | None,
    scale: float,
    tile: int,
    ops: ModuleType = ref,
    decode: DecodeMeta | None = None,
    norm_rope: tuple | None = None,
    store: bool = True,
    commit: bool = True,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """q: [N, H, D], k/v: [N, KVH, D] new rows; k/v_rows: a layer's flat physical rows
    [R, KVH, D] -> [N, H, D]. `decode`: the metadata of the step's decode group (its leading
    one-row sequences), attended in one batched call; `plans`: the sequences after it.

    The rows of plans written in place must already be stored (store first: the step's
    `stores`, by ops.qk_norm_rope_pair); a STAGING plan's rows are committed here, after the
    shadow was attended. Decode stores its rows itself; given `norm_rope` (decode rows alone,
    ops.decode_attention's), q and k are the projection's raw rows and it normalizes and
    rotates them itself too.

    A layer reading another layer's cache (KV sharing) passes `store` False: its k/v are the
    owner's rows of this step, already stored (None on a step of decode rows alone). `commit`
    False leaves a STAGING plan's rows uncommitted, for the cache's last reader to commit.
    `dtype`: the dots' dtype over an FP8 cache (muser/ops/kv_fp8.py; the model's), whose
    chunks never attend their new rows directly: they read the codes stored (or staged)."""
    outs = []
    if decode is not None:
        num = decode.src.shape[0]
        outs.append(ops.decode_attention(q if num == q.shape[0] else q[:num], k_rows, v_rows,
                                         decode.block_table, decode.starts, decode.lens,
                                         decode.origins, decode.block_size, scale,
                                         new=(k, v, decode.src, decode.write_dst) if store
                                         else None, norm_rope=norm_rope, dtype=dtype))
    assert norm_rope is None or not plans, "norm_rope: a step of decode rows alone"
    whole = not outs and len(plans) == 1  # one sequence: its rows are all of them
    for p in plans:
        kn, vn = (k, v) if whole else (k[p.rows], v[p.rows])
        read = None
        if p.k_start == p.q_start and kn.dtype == vn.dtype == k_rows.dtype:
            keys, values = kn, vn  # nothing cached before the chunk: its own rows
        elif p.staging or not p.tiles_in_place:
            new = (kn, vn) if p.staging else (None, None)
            keys, values = ops.stage_gather(k_rows, v_rows, p.read_rows, *new)
        else:  # NOTE: the cache itself, its rows read where they are (no gather)
            keys, values, read = k_rows, v_rows, p.read_rows
        outs.append(ops.prefill_attention(q if whole else q[p.rows], keys, values, p.q_start,
                                          p.k_start, window, scale, p.tiles, tile, p.inner,
                                          p.tile_ranges, read, dtype=dtype))
        if p.staging and commit:  # NOTE: commit only after the shadow was attended.
            ops.store_kv(k_rows, v_rows, kn, vn, p.write_src, p.write_dst)
    return outs[0] if len(outs) == 1 else torch.cat(outs)
