"""Every attention route against a float64 dense reference over the logical sequence."""

from __future__ import annotations

import torch

from muser.attention.layer import attend
from muser.attention.plan import SeqInput, plan_step
from muser.attention.routes import SHORT_CHUNK_ROWS, Route, choose_route
from muser.config import ModelConfig
from muser.kvcache.pool import KVPool
from muser.kvcache.ring import RingState
from muser.ops import ref as ref_ops
from muser.ops.dense_ref import attention_dense
from tests.error_bounds import attention_bound

WINDOW, TILE, PAGE = 32, 8, 16
CFG = ModelConfig(
    architecture="test", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, layer_kinds=("sliding", "global"),
    sliding_window=WINDOW, rope_theta=1e6, rope_local_theta=1e4,
)


class Sequence:
    """One sequence's cache placement plus every K/V row it ever produced, in float64."""

    def __init__(self, slot: int, page_ids: list[int]) -> None:
        self.slot, self.page_ids, self.start = slot, page_ids, 0
        self.ring = RingState(WINDOW)
        self.k = {kind: torch.empty(0, CFG.num_kv_heads, CFG.head_dim, dtype=torch.float64)
                  for kind in ("sliding", "global")}
        self.v = {kind: t.clone() for kind, t in self.k.items()}


def _step(pool: KVPool, seqs: list[Sequence], sizes: list[int], gen: torch.Generator,
          force_f32: bool = False) -> set[Route]:
    """Run one step over both kinds; assert each sequence's output equals the reference."""
    inputs = [SeqInput(s.slot, s.start, n, s.ring, tuple(s.page_ids)) for s, n in zip(seqs, sizes)]
    plan = plan_step(CFG, inputs, PAGE, TILE, force_f32)
    n = sum(sizes)
    seen = set()
    for layer_id, kind in enumerate(CFG.layer_kinds):
        q = torch.randn(n, CFG.num_heads, CFG.head_dim, generator=gen)
        k = torch.randn(n, CFG.num_kv_heads, CFG.head_dim, generator=gen)
        v = torch.randn(n, CFG.num_kv_heads, CFG.head_dim, generator=gen)
        window = WINDOW if kind == "sliding" else None
        k_rows, v_rows = pool.rows(layer_id)
        for p in plan.kinds[kind]:  # store first, as the decoder does for plans in place
            if not p.staging:
                ref_ops.store_kv(k_rows, v_rows, k[p.rows], v[p.rows], p.write_src, p.write_dst)
        out = attend(q, k, v, k_rows, v_rows, plan.kinds[kind], window, 0.25, TILE)
        for s, p in zip(seqs, plan.kinds[kind]):
            s.k[kind] = torch.cat((s.k[kind], k[p.rows].double()))
            s.v[kind] = torch.cat((s.v[kind], v[p.rows].double()))
            total = s.k[kind].shape[0]
            q_pos = torch.arange(s.start, s.start + p.rows.stop - p.rows.start)
            ref = attention_dense(q[p.rows], s.k[kind], s.v[kind], q_pos, torch.arange(total),
                                  window, 0.25, torch.float64)
            k_pos = torch.arange(total)
            visible = (k_pos[None] <= q_pos[:, None]) & (
                True if window is None else k_pos[None] > q_pos[:, None] - window)
            # the float32 routes sum in any order: D + 1 roundings per score
            bound = attention_bound(q[p.rows], s.k[kind], s.v[kind], 0.25, visible,
                                    CFG.head_dim + 1)
            assert ((out[p.rows].double() - ref).abs() <= bound).all()
            seen.add(p.route)
            seen.add(p.inner)
    for s, n_rows, ring in zip(seqs, sizes, plan.next_rings):
        s.start += n_rows
        s.ring = ring
    return seen


def test_every_route_matches_float64_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(CFG, num_slots=4, ring_capacity=WINDOW, num_pages=32, page_size=PAGE,
                  dtype=torch.float32, device="cpu")
    a, b, c = Sequence(2, list(range(8))), Sequence(0, list(range(8, 16))), Sequence(
        1, list(range(23, 15, -1)))
    d = Sequence(3, list(range(24, 32)))  # one chunk longer than two windows
    seen: set[Route] = set()
    schedule = [  # (sequences, rows each): in-place routes, then wrapped rings
        ([a], [20]), ([a], [5]), ([a], [1]), ([b], [3]), ([b], [17]),
        ([a], [17]), ([a], [16]), ([a], [16]), ([a], [3]), ([a, b, c], [1, 1, 1]),
        ([c], [40]), ([a, b, c], [1, 1, 1]), ([b], [24]), ([a, b, c], [1, 1, 1]),
        ([d], [80]), ([d, a], [1, 1]),
    ]
    for seqs, sizes in schedule:
        seen |= _step(pool, seqs, sizes, gen)
    seen |= _step(pool, [c], [9], gen, force_f32=True)
    assert seen == set(Route)


def test_tile_classifier_never_reads_empty_tiles() -> None:
    from muser.ops.tiles import EMPTY, FULL, PARTIAL, classify_tiles

    tiles = classify_tiles(100, 40, 60, 80, 32, 8, 8)
    q = torch.arange(100, 140)[:, None]
    k = torch.arange(60, 140)[None, :]
    visible = (k <= q) & (q - k < 32)
    for i in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            block = visible[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8]
            expected = FULL if block.all() else PARTIAL if block.any() else EMPTY
            assert tiles[i, j] == expected
    assert (tiles == EMPTY).any() and (tiles == FULL).any()


def test_choose_route_is_pure_and_total() -> None:
    fresh, wrapped = RingState(WINDOW), RingState(WINDOW, 5, 5, WINDOW)
    assert choose_route("sliding", 1, 40, wrapped, TILE) == Route.DECODE
    assert choose_route("sliding", 2, 40, wrapped, TILE) == Route.STAGING
    assert choose_route("global", SHORT_CHUNK_ROWS - 1, 3, None, TILE) == Route.SHORT_CHUNK
    assert choose_route("sliding", SHORT_CHUNK_ROWS, 0, fresh, TILE) == Route.TILED
    assert choose_route("global", SHORT_CHUNK_ROWS, 3, None, TILE) == Route.DENSE
    assert choose_route("global", 300, 3, None, TILE, force_f32=True) == Route.FALLBACK_F32
