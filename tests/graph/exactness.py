"""Run a prompt through the runner at a given chunk width and capture logits and KV rows at
chosen positions (KV rows are read right after they are written, before a ring drops them)."""

from __future__ import annotations

import torch

from muser.runner import Runner, SeqState


def kv_rows(runner: Runner, seq: SeqState, layer_id: int, pos: int) -> torch.Tensor:
    """[2, kv_heads, head_dim] K and V of logical row `pos`, located through cache metadata."""
    k, v = runner.pool.layer(layer_id)
    if runner.cfg.layer_kinds[layer_id] == "sliding":
        ring = seq.ring
        assert ring.logical_origin <= pos < ring.logical_end, "row already dropped"
        block, row = seq.slot, (ring.physical_origin + pos - ring.logical_origin) % ring.capacity
    else:
        page = runner.engine.page_size
        block, row = seq.page_ids[pos // page], pos % page
    return torch.stack((k[block, row], v[block, row])).float()


def capture(
    runner: Runner, ids: list[int], chunk: int, positions: set[int]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Prefill `ids` in chunks of `chunk` rows -> ({pos: logits}, {pos: [layers, 2, kvh, hd]})."""
    seq = runner.allocate()
    logits, kv = {}, {}
    try:
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            wanted = sorted(p for p in positions if start <= p < start + len(piece))
            out = runner.forward([seq], [piece], logit_rows=[p - start for p in wanted] or [0])
            for row, p in enumerate(wanted):
                logits[p] = out[row].clone()
                kv[p] = torch.stack([kv_rows(runner, seq, layer, p)
                                     for layer in range(runner.cfg.num_layers)])
    finally:
        runner.free(seq)
    return logits, kv


def capture_one_chunk(
    runner: Runner, ids: list[int], positions: set[int]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """For each position p, prefill ids[:p + 1] as one chunk and capture row p."""
    logits, kv = {}, {}
    for p in sorted(positions):
        one = capture(runner, ids[:p + 1], p + 1, {p})
        logits[p], kv[p] = one[0][p], one[1][p]
    return logits, kv


def max_diff(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> float:
    """Largest |a - b| over every captured position; NaN anywhere counts as infinite."""
    assert a.keys() == b.keys()
    diffs = [(a[p] - b[p]).abs().nan_to_num(float("inf")).max() for p in a]
    return max(float(d) for d in diffs)
