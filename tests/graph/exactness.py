"""Run a prompt through the runner at a given chunk width and capture logits and KV rows at
chosen positions (KV rows are read right after they are written, before a ring drops them)."""

from __future__ import annotations

import torch

from muser.kvcache.placement import Placement
from muser.runner import Runner


def kv_rows(runner: Runner, seq: Placement, layer_id: int, pos: int) -> torch.Tensor:
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


def every_layer_rows(runner: Runner, seq: Placement, pos: int) -> torch.Tensor:
    """kv_rows of every layer, flattened and concatenated (each kind has its own geometry)."""
    return torch.cat([kv_rows(runner, seq, layer, pos).flatten()
                      for layer in range(runner.cfg.num_layers)])


def capture(
    runner: Runner, ids: list[int], chunk: int, positions: set[int]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Prefill `ids` in chunks of `chunk` rows -> ({pos: logits}, {pos: every_layer_rows})."""
    seq = runner.allocate()
    logits, kv = {}, {}
    try:
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            wanted = sorted(p for p in positions if start <= p < start + len(piece))
            # no LM head on a chunk without a wanted position (the engine's middle chunks):
            # 262,144 logits a row cost more than the rest of a 270M forward
            out = runner.forward([seq], [piece], logit_rows=[p - start for p in wanted])
            for row, p in enumerate(wanted):
                logits[p] = out[row].clone()
                kv[p] = every_layer_rows(runner, seq, p)
    finally:
        runner.free(seq)
    return logits, kv


def capture_one_chunk(
    runner: Runner, ids: list[int], positions: set[int]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Each position p from a one-chunk prefill of a prefix of ids that ends within a window
    after p (the ring still holds row p): prefixes ending at multiples of the window."""
    window = runner.cfg.sliding_window
    logits, kv = {}, {}
    ends: dict[int, set[int]] = {}
    for p in positions:
        ends.setdefault(min(len(ids), (p // window + 1) * window), set()).add(p)
    for end, wanted in ends.items():
        one = capture(runner, ids[:end], end, wanted)
        logits.update(one[0])
        kv.update(one[1])
    return logits, kv


def capture_in_batch(
    runner: Runner, ids: list[int], chunk: int, positions: set[int],
    others: list[list[int]], other_rows: list[int],
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Like capture(), but every step also carries rows of other sequences: each of `others`
    is first prefilled alone, then brings `other_rows[i]` more of its ids per step (1: a
    decode row) beside this prompt's chunk."""
    seq, mates = runner.allocate(), [runner.allocate() for _ in others]
    taken = [len(o) // 2 for o in others]
    logits, kv = {}, {}
    try:
        for mate, o, n in zip(mates, others, taken):
            runner.forward([mate], [o[:n]])
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            rows = [o[n:n + k] for o, n, k in zip(others, taken, other_rows)]
            taken = [n + len(r) for n, r in zip(taken, rows)]
            step = [(s, r) for s, r in zip(mates, rows) if r]
            wanted = sorted(p for p in positions if start <= p < start + len(piece))
            offset = sum(len(r) for _, r in step)  # this prompt's rows come last
            out = runner.forward([s for s, _ in step] + [seq], [r for _, r in step] + [piece],
                                 logit_rows=[offset + p - start for p in wanted])
            for row, p in enumerate(wanted):
                logits[p] = out[row].clone()
                kv[p] = every_layer_rows(runner, seq, p)
    finally:
        for s in [seq, *mates]:
            runner.free(s)
    return logits, kv


def first_difference(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> str | None:
    """None when every captured position is bitwise equal, else where and by how much not."""
    assert a.keys() == b.keys()
    for p in sorted(a):
        if not torch.equal(a[p], b[p]):
            return f"position {p}: max |diff| {float((a[p] - b[p]).abs().max()):.3g}"
    return None
