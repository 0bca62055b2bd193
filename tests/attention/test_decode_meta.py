"""The decode step's packed metadata (one int32 buffer) against the ring and page tables."""

from __future__ import annotations

import torch

from muser.attention.decode_meta import DecodeLayout
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
        assert layout.view(buf, "sliding.lens")[b] == after.length
        assert layout.view(buf, "global.write_dst")[b] == s.page_ids[s.start // page] * page + (
            s.start % page)
        assert layout.view(buf, "global.lens")[b] == s.start + 1
    assert layout.view(buf, "input_ids")[:2].tolist() == [17, 23]
    assert layout.view(buf, "sliding.write_dst")[2:].tolist() == [-1, -1]  # padding rows
    assert layout.view(buf, "global.lens")[2:].tolist() == [0, 0]
    assert layout.pack(buf, CFG, [], []) == []
    assert (layout.view(buf, "global.write_dst") == -1).all()
