"""Per-step attention metadata: one plan per sequence and layer kind, prepared once per step
and shared by every layer of that kind."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muser.attention.routes import Route, choose_route, inner_route
from muser.config import LayerKind, ModelConfig
from muser.kvcache.ring import RingState
from muser.ops.tiles import classify_tiles


@dataclass(frozen=True, slots=True)
class SeqInput:
    """What the runner knows about one sequence in a step (host integers)."""

    slot: int
    start: int  # logical position of the first new row == rows already cached
    num_rows: int
    ring: RingState
    page_ids: tuple[int, ...]  # must cover positions [0, start + num_rows)


@dataclass(slots=True)
class SeqPlan:
    rows: slice  # this sequence's rows in the step's flat batch
    route: Route
    inner: Route  # computation over the attended keys (STAGING: the shadow's route)
    staging: bool  # attend a detached shadow, commit to the cache afterwards
    q_start: int
    k_start: int  # logical position of read_rows[0]
    read_rows: torch.Tensor  # flat physical rows attended, logical order (STAGING: tail only)
    write_src: torch.Tensor  # which new rows are stored
    write_dst: torch.Tensor  # where: flat physical rows of the layer's store
    tiles: torch.Tensor | None
    tile_ranges: torch.Tensor | None = None  # device plans: classifier_ranges of `tiles`
    # read_rows are consecutive within every key tile, so the keys can be attended where they
    # are (ops.prefill_attention's read_rows); else they are gathered first
    tiles_in_place: bool = True


@dataclass(slots=True)
class StepPlan:
    kinds: dict[str, list[SeqPlan]]
    next_rings: list[RingState]  # ring metadata once the step has committed
    window: int
    tile: int
    # kind -> [N] flat cache row of each new row stored before attention (plans written in
    # place; -1: stored after attention, a STAGING plan's rows); empty on a decode step
    stores: dict[str, torch.Tensor]
    # rows of the leading one-row sequences attended as one batch (no per-sequence plans)
    num_decode: int = 0
    decode: dict | None = None  # kind -> DecodeMeta of those num_decode rows


def plan_step(
    cfg: ModelConfig, seqs: list[SeqInput], page_size: int, tile: int, force_f32: bool = False,
    batch_decode: bool = False,
) -> StepPlan:
    """Routes, tiles and row indices for every (sequence, kind) of one forward step.

    batch_decode: the leading one-row sequences form the step's decode group (`num_decode`):
    they attend in one batched call from the decode metadata (attention/decode_meta.py), so
    they get no per-sequence plan; `kinds` holds the plans of the sequences after them. (The
    scheduler puts decode rows first, so in a serving step every one-row sequence is in it.)"""
    num_decode = 0
    while batch_decode and not force_f32 and num_decode < len(seqs) and (
            seqs[num_decode].num_rows == 1):
        num_decode += 1
    kinds: dict[str, list[SeqPlan]] = {"sliding": [], "global": []}
    next_rings = [seq.ring.advance(1) for seq in seqs[:num_decode]]
    offset = num_decode
    for seq in seqs[num_decode:]:
        rows = slice(offset, offset + seq.num_rows)
        offset += seq.num_rows
        sliding = _plan_sliding(cfg, seq, rows, tile, force_f32)
        kinds["sliding"].append(sliding[0])
        next_rings.append(sliding[1])
        kinds["global"].append(_plan_global(seq, rows, page_size, tile, force_f32))
    stores = {} if num_decode == len(seqs) else {
        kind: _stores(plans, offset) for kind, plans in kinds.items()}
    return StepPlan(kinds, next_rings, cfg.sliding_window, tile, stores, num_decode)


def _stores(plans: list[SeqPlan], num_rows: int) -> torch.Tensor:
    """[N] destination row of each new row stored before attention, else -1."""
    dst = torch.full((num_rows,), -1, dtype=torch.long)
    for p in plans:
        if not p.staging:
            dst[p.rows][p.write_src] = p.write_dst
    return dst


def _plan_sliding(
    cfg: ModelConfig, seq: SeqInput, rows: slice, tile: int, force_f32: bool
) -> tuple[SeqPlan, RingState]:
    ring, n, window = seq.ring, seq.num_rows, cfg.sliding_window
    route = choose_route("sliding", n, seq.start, ring, tile, force_f32)
    next_ring = ring.advance(n)
    kept, first = ring.writes(n)
    base = seq.slot * ring.capacity
    staging = n > 1 and not ring.can_append_in_place(n)
    if n == 1:  # stored first, then the newest `window` rows are visible
        read = torch.tensor(next_ring.tail(window), dtype=torch.long)
        k_start = next_ring.logical_end - len(read)
    elif staging:
        read = torch.tensor(ring.tail(window - 1), dtype=torch.long)
        k_start = ring.logical_end - len(read)
    else:  # contiguous ring: logical row i is physical row i
        k_start = max(0, seq.start - window + 1)
        read = torch.arange(k_start, seq.start + n)
    inner = inner_route(n, seq.start, tile) if route == Route.STAGING else route
    src = torch.arange(kept.start, kept.stop)
    dst = base + (first + torch.arange(len(kept))) % ring.capacity
    num_keys = len(read) + (n if staging else 0)
    plan = SeqPlan(
        rows, route, inner, staging, seq.start, k_start, read + base, src, dst,
        _tiles(inner, seq.start, n, k_start, num_keys, window, tile),
        tiles_in_place=n > 1 and not staging,  # one row: the ring's tail may wrap
    )
    return plan, next_ring


def _plan_global(
    seq: SeqInput, rows: slice, page_size: int, tile: int, force_f32: bool
) -> SeqPlan:
    n, end = seq.num_rows, seq.start + seq.num_rows
    route = choose_route("global", n, seq.start, None, tile, force_f32)
    # flat row of each position: its page's first row + its offset in the page (one broadcast:
    # a chunk at 131k keys computed it per position in 4 ms of host time before its kernels)
    pages = torch.tensor(seq.page_ids[:-(-end // page_size)], dtype=torch.long)
    flat = (pages[:, None] * page_size + torch.arange(page_size)).view(-1)[:end]
    return SeqPlan(
        rows, route, route, False, seq.start, 0, flat, torch.arange(n), flat[seq.start:],
        _tiles(route, seq.start, n, 0, end, None, tile), tiles_in_place=page_size % tile == 0,
    )


def _tiles(
    route: Route, q_start: int, n: int, k_start: int, num_keys: int, window: int | None, tile: int
) -> torch.Tensor | None:
    if route != Route.TILED:
        return None
    return classify_tiles(q_start, n, k_start, num_keys, window, tile, tile)


def kind_window(kind: LayerKind, cfg: ModelConfig) -> int | None:
    return cfg.sliding_window if kind == "sliding" else None
