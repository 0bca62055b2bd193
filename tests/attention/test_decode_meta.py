"""The decode step's packed metadata (one int32 buffer) against the ring and page tables."""

from __future__ import annotations

import torch

from muser.attention.decode_meta import AheadPacker, DecodeLayout
from muser.attention.plan import SeqInput
from muser.config import ModelConfig, gemma3_layer_kinds
from muser.kvcache.ring import RingState

CFG = ModelConfig(
    architecture="gemma3", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=32, layer_kinds=gemma3_layer_kinds(2, pattern=2),
    sliding_window=8, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=32.0,
)


def test_pack_writes_each_row_where_its_ring_and_pages_put_it():
    cap, page = 8, 4
    full = RingState(cap).append(11)[0]  # wrapped: the next row overwrites the oldest
    partial = RingState(cap).append(3)[0]
    seqs = [SeqInput(1, 11, 1, full, (5, 2, 7)), SeqInput(0, 3, 1, partial, (4,))]
    layout = DecodeLayout(4, cap, page, max_pages=3)
    buf = torch.empty(layout.size, dtype=torch.int32)
    rings = layout.pack(buf, CFG, seqs, [17, 23])
    for b, s in enumerate(seqs):
        after, writes = s.ring.append(1)
        assert rings[b] == after
        assert layout.view(buf, "sliding.write_dst")[b] == s.slot * cap + writes[0][1]
        # ring keys named by logical position: [starts, lens) are the window's positions, and
        # position i sits at physical (origins + i) mod cap, where the ring put it
        start, end = (int(layout.view(buf, f"sliding.{f}")[b]) for f in ("starts", "lens"))
        assert end == after.logical_end == s.start + 1
        assert start == max(after.logical_origin, end - CFG.sliding_window)
        origin = int(layout.view(buf, "sliding.origins")[b])
        assert [(origin + i) % cap for i in range(start, end)] == after.tail(end - start)
        assert (origin + end - 1) % cap == writes[0][1]  # the newest key: the row stored
        assert layout.view(buf, "global.write_dst")[b] == s.page_ids[s.start // page] * page + (
            s.start % page)
        assert layout.view(buf, "global.lens")[b] == s.start + 1
    assert layout.view(buf, "input_ids")[:2].tolist() == [17, 23]
    assert layout.view(buf, "sliding.write_dst")[2:].tolist() == [-1, -1]  # padding rows
    assert layout.view(buf, "global.lens")[2:].tolist() == [0, 0]
    assert layout.pack(buf, CFG, [], []) == []
    assert (layout.view(buf, "global.write_dst") == -1).all()


def test_packing_ahead_equals_packing_each_step():
    """Steps packed one ahead (the guess: every sequence goes on) give the buffer a fresh pack
    gives, including across a ring wrap; a changed batch or a new page falls back to packing."""
    cap, page = 8, 4
    layout = DecodeLayout(4, cap, page, max_pages=4)
    packer = AheadPacker(layout)
    seqs = [SeqInput(1, 6, 1, RingState(cap).append(6)[0], (5, 2)),
            SeqInput(0, 2, 1, RingState(cap).append(2)[0], (4,))]
    ahead, fresh = (torch.empty(layout.size, dtype=torch.int32) for _ in range(2))
    staged_steps = 0
    for step in range(6):
        ids = [100 + step, 200 + step]
        staged_steps += packer.staged_for is not None
        rings = packer.pack(ahead, CFG, seqs, ids)
        assert rings == layout.pack(fresh, CFG, seqs, ids)
        assert torch.equal(ahead, fresh), step
        packer.pack_ahead(CFG, seqs, rings)
        pages = [s.page_ids + (9 + b,) * ((s.start + 1) // page >= len(s.page_ids))
                 for b, s in enumerate(seqs)]  # the runner's page for a row past the last
        seqs = [SeqInput(s.slot, s.start + 1, 1, r, p) for s, r, p in zip(seqs, rings, pages)]
    assert 0 < staged_steps < 6  # some steps were staged, the page-crossing ones were not
    seqs = seqs[:1]  # the batch changed: no staged pack applies
    rings = packer.pack(ahead, CFG, seqs, [7])
    assert rings == layout.pack(fresh, CFG, seqs, [7]) and torch.equal(ahead, fresh)


def test_every_field_starts_16_byte_aligned_whatever_the_batch() -> None:
    # Triton specializes kernels on pointer alignment: offsets that followed the batch size
    # would compile new kernel variants while serving
    from muser.attention.decode_meta import ALIGN, DecodeLayout

    for width in (1, 2, 3, 5, 17, 33):
        for max_pages in (1, 3, 16):
            layout = DecodeLayout(width, 512, 16, max_pages)
            assert all(offset % ALIGN == 0 for offset, _ in layout.fields.values())
            assert layout.size % ALIGN == 0
