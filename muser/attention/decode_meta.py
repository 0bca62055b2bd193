"""Device-side attention metadata: the batched decode metadata of each layer kind (one
launch for all sequences, CUDA-graph capturable) and the device copy of a prefill plan.

Decode metadata lives in ONE int32 buffer, so a step costs one host-to-device copy:

    field          shape              sliding (ring)                 global (pages)
    input_ids      [B]
    positions      [B]
    src            [B]                0..B-1                         0..B-1
    write_dst      [B]                slot * cap + next physical     page[pos // ps] * ps + ..
    block_table    [B, blocks]        [slot]  (1 block of cap rows)  page ids
    starts         [B]                max(origin, end - window)      0
    lens           [B]                ring logical end after store   pos + 1
    origins        [B]                (phys. - logical origin) % cap 0

Ring keys are named by logical position: key i at physical (origins + i) mod cap.

Padding rows (b >= number of sequences) have write_dst = -1 and lens = 0: they store
nothing and attend nothing. Every field (and every tensor `upload` packs) starts at a multiple
of ALIGN elements: Triton specializes a kernel on whether each pointer is 16-byte aligned, so
offsets that followed the batch size would compile new variants while serving.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from muser.attention.plan import SeqInput, StepPlan
from muser.config import ModelConfig
from muser.kvcache.ring import RingState
from muser.ops.tiles import classify_tiles


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
            offset += _aligned(math.prod(shape))
        self.size = offset
        self._views: dict[int, tuple[torch.Tensor, dict]] = {}  # per packed buffer (<= 2)

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
        # NOTE: in logical positions (the ring's physical origin shifted to match), so kernels
        # can anchor key tiles at positions (muser/ops/triton/softmax.py)
        f["sliding.starts"][:n] = [max(r.logical_origin, r.logical_end - cfg.sliding_window)
                                   for r, _ in rings]
        f["sliding.lens"][:n] = [r.logical_end for r, _ in rings]
        f["sliding.origins"][:n] = [(r.physical_origin - r.logical_origin) % cap
                                    for r, _ in rings]
        f["global.write_dst"][:n] = [s.page_ids[s.start // ps] * ps + s.start % ps for s in seqs]
        table = f["global.block_table"]
        for b, s in enumerate(seqs):
            table[b, :len(s.page_ids)] = s.page_ids
        f["global.lens"][:n] = [s.start + 1 for s in seqs]
        return [ring for ring, _ in rings]

    def repack(self, buf: torch.Tensor, packed: torch.Tensor, token_ids: list[int]) -> None:
        """buf = packed (a buffer `pack` filled for the same sequences) with these token ids."""
        f = self._numpy_views(buf)
        f["all"][:] = self._numpy_views(packed)["all"]
        f["input_ids"][:len(token_ids)] = token_ids

    def _numpy_views(self, buf: torch.Tensor) -> dict:
        cached = self._views.get(id(buf))
        if cached is None or cached[0] is not buf:
            if len(self._views) >= 2:
                self._views.clear()
            a = buf.numpy()
            views = {name: a[o:o + math.prod(shape)].reshape(shape)
                     for name, (o, shape) in self.fields.items()}
            cached = self._views[id(buf)] = (buf, views | {"all": a})
        return cached[1]


class AheadPacker:
    """Decode packing, done one step ahead: after a step is launched, the next step's metadata
    is packed into a staging buffer on the guess that every sequence goes on by one row (the
    usual case), while the GPU runs. The next `pack` then only copies it and writes the token
    ids, when its sequences are exactly the guessed ones (same slots, positions, rings and
    pages); otherwise it packs as usual."""

    def __init__(self, layout: DecodeLayout):
        self.layout = layout
        self.staged = torch.zeros(layout.size, dtype=torch.int32)
        self.staged_for: tuple | None = None
        self.staged_rings: list[RingState] = []

    def pack(self, buf: torch.Tensor, cfg: ModelConfig, seqs: list[SeqInput],
             token_ids: list[int]) -> list[RingState]:
        """layout.pack(buf, cfg, seqs, token_ids), from the staged pack when it matches."""
        if self.staged_for is not None and self.staged_for == _seqs_key(seqs):
            self.layout.repack(buf, self.staged, token_ids)
            return self.staged_rings
        return self.layout.pack(buf, cfg, seqs, token_ids)

    def pack_ahead(self, cfg: ModelConfig, seqs: list[SeqInput], rings: list[RingState]) -> None:
        """Stage the step after the one just packed for `seqs` (whose rings are then `rings`).
        A sequence whose next row needs a page it does not hold yet is left to `pack`."""
        self.staged_for = None
        if any((s.start + 1) // self.layout.page_size >= len(s.page_ids) for s in seqs):
            return
        nxt = [SeqInput(s.slot, s.start + 1, 1, r, s.page_ids) for s, r in zip(seqs, rings)]
        self.staged_rings = self.layout.pack(self.staged, cfg, nxt, [0] * len(nxt))
        self.staged_for = _seqs_key(nxt)


ALIGN = 4  # int32 elements: 16 bytes


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _seqs_key(seqs: list[SeqInput]) -> tuple:
    return tuple((s.slot, s.start, s.num_rows, s.ring, s.page_ids) for s in seqs)


def _decode_ring(ring: RingState) -> tuple[RingState, int]:
    """(ring after storing one row, the physical row it is stored at)."""
    next_ring, writes = ring.append(1)
    return next_ring, writes[-1][1]


def prepare_plan(plan: StepPlan, cfg: ModelConfig, seqs: list[SeqInput], token_ids: list[int],
                 page_size: int, device: torch.device, inputs: list[torch.Tensor] = (),
                 max_pages: int | None = None) -> tuple[StepPlan, list[torch.Tensor]]:
    """Add the batched decode metadata of the plan's decode group; on CUDA also move each
    chunk's plan to the device, with its tile classifier and tile ranges. `inputs` (host int
    tensors: the step's ids, positions...) travel with the metadata, in one copy -> (plan,
    their device copies). max_pages: the decode block table's width (default: the group's
    most pages; a fixed width keeps the decode kernel's shapes fixed)."""
    num_decode, cuda = plan.num_decode, torch.device(device).type == "cuda"
    host = list(inputs)
    if num_decode:
        group = seqs[:num_decode]
        width = max_pages or max(len(s.page_ids) for s in group)
        layout = DecodeLayout(num_decode, group[0].ring.capacity, page_size, width)
        packed = torch.empty(layout.size, dtype=torch.int32)
        layout.pack(packed, cfg, group, token_ids[:num_decode])
        host.append(packed)
    if cuda:
        from muser.ops.triton.prefill_attention import classifier_ranges

        tile = plan.tile
        host += list(plan.stores.values())
        for kind, plans in plan.kinds.items():
            window = cfg.sliding_window if kind == "sliding" else None
            for p in plans:
                num_q = p.rows.stop - p.rows.start
                num_k = len(p.read_rows) + (num_q if p.staging else 0)
                tiles = p.tiles if p.tiles is not None else classify_tiles(
                    p.q_start, num_q, p.k_start, num_k, window, tile, tile)
                host += [p.read_rows, p.write_src, p.write_dst, tiles, classifier_ranges(tiles)]
    moved = iter(upload(host, device))
    inputs = [next(moved) for _ in inputs]
    if num_decode:
        plan.decode = layout.metas(next(moved), num_decode)
    if not cuda:
        return plan, inputs
    plan.stores = {kind: next(moved) for kind in plan.stores}
    for plans in plan.kinds.values():
        for i, p in enumerate(plans):
            plans[i] = dataclasses.replace(
                p, read_rows=next(moved), write_src=next(moved), write_dst=next(moved),
                tiles=next(moved), tile_ranges=next(moved))
    return plan, inputs


def upload(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host integer tensors -> int32 device tensors of the same shapes, in one copy (each copy
    costs a driver call; a prefill step's metadata is ~a dozen small tensors), each starting
    16-byte aligned."""
    if torch.device(device).type == "cpu":  # nothing to copy: the CPU decode step runs here
        return [t.to(torch.int32) for t in tensors]
    if not tensors:
        return []
    sizes = [_aligned(t.numel()) for t in tensors]
    # NOTE: staged in pinned memory: a copy from pageable memory first waits for the stream to
    # drain, so every prefill chunk would start on an idle GPU behind the host's launches (the
    # caching host allocator keeps the buffer until the copy has run)
    flat = torch.zeros(sum(sizes), dtype=torch.int32, pin_memory=True)
    offset = 0
    for t, size in zip(tensors, sizes):
        flat[offset:offset + t.numel()] = t.reshape(-1)
        offset += size
    flat = flat.to(device, non_blocking=True)
    return [part[:t.numel()].view(t.shape) for part, t in zip(flat.split(sizes), tensors)]
