"""Device-side attention metadata: the batched decode metadata of each layer kind (one
launch for all sequences, CUDA-graph capturable) and the device copy of a prefill plan.

Decode metadata lives in ONE int32 buffer, so a step costs one host-to-device copy:

    field          shape              sliding (ring)                 global (pages)
    input_ids      [B]
    positions      [B]
    src            [B]                0..B-1                         0..B-1
    write_dst      [B]                slot * cap + next physical     page[pos // ps] * ps + ..
    block_table    [B, blocks]        [slot]  (1 block of cap rows)  page ids
    starts         [B]                max(0, length - window)        0
    lens           [B]                ring length after the store    pos + 1
    origins        [B]                ring physical origin           0

Padding rows (b >= number of sequences) have write_dst = -1 and lens = 0: they store
nothing and attend nothing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from muser.attention.plan import SeqInput, SeqPlan, StepPlan
from muser.attention.tiles import classify_tiles
from muser.config import ModelConfig
from muser.kvcache.ring import RingState


@dataclass(slots=True)
class DecodeMeta:
    """One kind's decode metadata: int32 device views (see the module table)."""

    src: torch.Tensor
    write_dst: torch.Tensor
    block_table: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor
    origins: torch.Tensor
    block_size: int


class DecodeLayout:
    """Where each field sits in the flat int32 buffer, for `width` rows."""

    def __init__(self, width: int, ring_capacity: int, page_size: int, max_pages: int):
        self.width, self.capacity, self.page_size, self.max_pages = (
            width, ring_capacity, page_size, max_pages)
        self.fields: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in [("input_ids", (width,)), ("positions", (width,))] + [
            (f"{kind}.{f}", (width, blocks) if f == "block_table" else (width,))
            for kind, blocks in (("sliding", 1), ("global", max_pages))
            for f in ("src", "write_dst", "block_table", "starts", "lens", "origins")
        ]:
            self.fields[name] = (offset, shape)
            offset += math.prod(shape)
        self.size = offset
        self._views: tuple[torch.Tensor, dict] | None = None  # the last packed buffer's views

    def view(self, buf: torch.Tensor, name: str, rows: int | None = None) -> torch.Tensor:
        offset, shape = self.fields[name]
        t = buf[offset:offset + math.prod(shape)].view(shape)
        return t if rows is None else t[:rows]

    def metas(self, buf: torch.Tensor, rows: int) -> dict[str, DecodeMeta]:
        return {
            kind: DecodeMeta(
                *(self.view(buf, f"{kind}.{f}", rows) for f in (
                    "src", "write_dst", "block_table", "starts", "lens", "origins")),
                block_size=self.capacity if kind == "sliding" else self.page_size,
            )
            for kind in ("sliding", "global")
        }

    def pack(self, buf: torch.Tensor, cfg: ModelConfig, seqs: list[SeqInput],
             token_ids: list[int]) -> list[RingState]:
        """Fill host buffer `buf` for single-row sequences `seqs` (the rest is padding) -> each
        sequence's ring after this step's row. NOTE: numpy views of the (pinned) host buffer,
        made once per buffer: this runs once per decode step, before the GPU can start it."""
        f = self._numpy_views(buf)
        f["all"][:] = 0
        n, cap, ps = len(seqs), self.capacity, self.page_size
        f["sliding.write_dst"][n:] = -1
        f["global.write_dst"][n:] = -1
        if not n:
            return []
        rings = [_decode_ring(s.ring) for s in seqs]
        f["input_ids"][:n] = token_ids
        f["positions"][:n] = [s.start for s in seqs]
        f["sliding.src"][:n] = f["global.src"][:n] = range(n)
        f["sliding.write_dst"][:n] = [s.slot * cap + w for s, (_, w) in zip(seqs, rings)]
        f["sliding.block_table"][:n, 0] = [s.slot for s in seqs]
        f["sliding.starts"][:n] = [max(0, r.length - cfg.sliding_window) for r, _ in rings]
        f["sliding.lens"][:n] = [r.length for r, _ in rings]
        f["sliding.origins"][:n] = [r.physical_origin for r, _ in rings]
        f["global.write_dst"][:n] = [s.page_ids[s.start // ps] * ps + s.start % ps for s in seqs]
        table = f["global.block_table"]
        for b, s in enumerate(seqs):
            table[b, :len(s.page_ids)] = s.page_ids
        f["global.lens"][:n] = [s.start + 1 for s in seqs]
        return [ring for ring, _ in rings]

    def _numpy_views(self, buf: torch.Tensor) -> dict:
        if self._views is None or self._views[0] is not buf:
            a = buf.numpy()
            views = {name: a[o:o + math.prod(shape)].reshape(shape)
                     for name, (o, shape) in self.fields.items()}
            self._views = (buf, views | {"all": a})
        return self._views[1]


def _decode_ring(ring: RingState) -> tuple[RingState, int]:
    """(ring after storing one row, the physical row it is stored at)."""
    next_ring, writes = ring.append(1)
    return next_ring, writes[-1][1]


def prepare_plan(plan: StepPlan, cfg: ModelConfig, seqs: list[SeqInput], token_ids: list[int],
                 page_size: int, device: torch.device) -> StepPlan:
    """Add batched decode metadata when every sequence brings one row; on CUDA also move
    each sequence's prefill plan to the device, with its tile classifier and tile ranges."""
    if seqs and all(s.num_rows == 1 for s in seqs) and all(
            p.route.value == "decode" for p in plan.kinds["sliding"]):
        max_pages = max(len(s.page_ids) for s in seqs)
        layout = DecodeLayout(len(seqs), seqs[0].ring.capacity, page_size, max_pages)
        host = torch.empty(layout.size, dtype=torch.int32)
        layout.pack(host, cfg, seqs, token_ids)
        plan.decode = layout.metas(host.to(device), len(seqs))
        return plan
    if torch.device(device).type != "cuda":
        return plan
    from muser.ops.triton.prefill_attention import classifier_ranges

    tile = plan.tile
    for kind, plans in plan.kinds.items():
        window = cfg.sliding_window if kind == "sliding" else None
        for i, p in enumerate(plans):
            num_q = p.rows.stop - p.rows.start
            num_k = len(p.read_rows) + (num_q if p.staging else 0)
            tiles = p.tiles if p.tiles is not None else classify_tiles(
                p.q_start, num_q, p.k_start, num_k, window, tile, tile)
            tiles = tiles.to(device)
            plans[i] = dataclasses.replace(
                p, read_rows=p.read_rows.to(device), write_src=p.write_src.to(device),
                write_dst=p.write_dst.to(device), tiles=tiles,
                tile_ranges=classifier_ranges(tiles),
            )
    return plan
