"""KVSnapshot: one prefilled sequence's cache, detached from any pool, and its installation.

What a prefill leaves behind, in logical order:

    sliding   [sliding layers, 2 (K, V), ring length, kv_heads, head_dim]  the ring's retained
              rows, with the ring's metadata (logical origin, physical origin, length)
    full      [full layers, 2, num_tokens, kv_heads, head_dim]             every prompt row
    logits    [vocab] float32                                              the last row's

`export` copies them out of a runner's pool; `install` copies a verified snapshot into a fresh
slot and fresh pages of another runner and places the sequence, ring metadata and pages
together: nothing is visible to attention before it returns, so a snapshot that fails its
checks never leaves partial KV behind. The ring is restored at the same physical rows, so the
installed sequence attends its keys in the order the sender's would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from muser.errors import MuserError
from muser.kvcache.placement import Placement
from muser.kvcache.ring import RingState


@dataclass
class KVSnapshot:
    num_tokens: int
    ring: RingState
    sliding: torch.Tensor
    full: torch.Tensor
    logits: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.sliding, self.full, self.logits))

    def checksums(self) -> list[int]:
        """`layer_checksums` of each layer's K and V (sliding layers, then full), then the
        logits'."""
        return (layer_checksums(self.sliding) + layer_checksums(self.full)
                + layer_checksums(self.logits[None]))


MOD = 65521  # the largest prime below 2^16 (Adler-32's)
SLAB = 1 << 27  # words summed a pass (on a GPU their int64 copies: 1 GiB)


def layer_checksums(t: torch.Tensor) -> list[int]:
    """A checksum of the bytes of each t[i], computed where t lives (a GPU's KV never goes
    through the host to be checked) and the same on every device. Over the slice's 16-bit words
    w_j (signed), Adler-style: s1 = sum w_j and s2 = sum w_j * (j mod MOD + 1), exact in int64
    (|s2| < 2^15 * 2^16 * 2^31 words), so any order of summation gives the same bits ->
    (s1, s2) as one integer. One word changed changes s1; two words exchanged change s2 unless
    their positions are a multiple of MOD apart. Computed as the column sums of the words laid
    out MOD to a row, one pass over the bytes with no wider copy of them."""
    if t.shape[0] == 0:
        return []
    n, nbytes = t.shape[0], t[0].numel() * t.element_size()
    per = nbytes // 2
    assert nbytes % 2 == 0 and per < 2**31, "16-bit words, fewer than 2^31 a slice"
    words = t.detach().contiguous().view(-1).view(torch.uint8).view(torch.int16).view(n, per)
    rows = per // MOD
    cols = torch.zeros((n, MOD), dtype=torch.int64, device=t.device)
    step = max(1, SLAB // (n * MOD))  # NOTE: torch widens a pass's words to int64 first
    for r in range(0, rows, step):
        laid = words[:, r * MOD:min(rows, r + step) * MOD].reshape(n, -1, MOD)
        if t.device.type == "cpu":  # NOTE: numpy's widening sum is ~10x torch's on the CPU
            cols += torch.from_numpy(laid.numpy().sum(axis=1, dtype=np.int64))
        else:
            cols += laid.sum(1, dtype=torch.int64)
    tail = words[:, rows * MOD:].to(torch.int64)
    weights = torch.arange(1, MOD + 1, device=t.device)
    s1 = cols.sum(1) + tail.sum(1)
    s2 = (cols * weights).sum(1) + (tail * weights[:tail.shape[1]]).sum(1)
    return [a * 2**64 + b for a, b in zip(s1.tolist(), s2.tolist(), strict=True)]


def export(runner, seq: Placement, logits: torch.Tensor) -> KVSnapshot:
    """The cache of `seq` (every prompt row computed) on `runner`, copied out, with the logits
    of its last row."""
    cfg, pool, ring = runner.cfg, runner.pool, seq.ring
    ring_rows = torch.tensor(ring.tail(ring.length), dtype=torch.long, device=runner.device)
    ring_rows += seq.slot * ring.capacity
    full_rows = _page_rows(seq.page_ids, seq.num_cached, pool.page_size, runner.device)
    sliding = [torch.stack([r.index_select(0, ring_rows) for r in pool.rows(i)])
               for i in cfg.layers_of("sliding")]
    full = [torch.stack([r.index_select(0, full_rows) for r in pool.rows(i)])
            for i in cfg.layers_of("global")]
    return KVSnapshot(seq.num_cached, ring, _stacked(sliding, pool), _stacked(full, pool),
                      logits.detach().float().reshape(-1).clone())


def install(runner, snap: KVSnapshot, token_ids: list[int],
            seq: Placement | None = None) -> Placement:
    """`seq` (unplaced; default a new one) placed on `runner` holding `snap` of `token_ids`
    (converted to the pool's dtype and device): a free slot, pages for its rows, its ring ->
    it. Raises OutOfPages or RuntimeError (no free slot) having changed nothing.

    A ring of another capacity (an engine that speculates holds window + K rows, one that does
    not the window) is laid out anew: its newest `window` rows, the only ones a later row
    attends, from physical row 0."""
    cfg, pool = runner.cfg, runner.pool
    ring, sliding = snap.ring, snap.sliding
    if ring.capacity != pool.ring_capacity:
        keep = min(ring.length, cfg.sliding_window)
        ring = RingState(pool.ring_capacity, ring.logical_end - keep, 0, keep)
        sliding = sliding[:, :, sliding.shape[2] - keep:]
    seq = runner.allocate(seq=seq)
    try:
        runner.reserve(seq, snap.num_tokens)
    except Exception:
        runner.free(seq)
        raise
    device, dtype = runner.device, pool.dtype
    if (snap.full.dtype == torch.uint8) != (dtype == torch.uint8):
        # NOTE: uint8 is an FP8 cache's packed rows (muser/ops/kv_fp8.py): bytes, never cast
        raise MuserError(f"a KV snapshot of {snap.full.dtype} rows does not install into a "
                         f"{dtype} cache: FP8 and other KV dtypes do not convert")
    ring_rows = torch.tensor(ring.tail(ring.length), dtype=torch.long, device=device)
    ring_rows += seq.slot * ring.capacity
    full_rows = _page_rows(seq.page_ids, snap.num_tokens, pool.page_size, device)
    for layer, i in enumerate(cfg.layers_of("sliding")):
        for kv, rows in enumerate(pool.rows(i)):
            rows.index_copy_(0, ring_rows, sliding[layer, kv].to(device, dtype))
    for layer, i in enumerate(cfg.layers_of("global")):
        for kv, rows in enumerate(pool.rows(i)):
            rows.index_copy_(0, full_rows, snap.full[layer, kv].to(device, dtype))
    runner.commit(seq, list(token_ids), ring)
    return seq


def _page_rows(page_ids: list[int], n: int, page_size: int, device) -> torch.Tensor:
    """Flat physical rows of logical rows 0 .. n-1 of a sequence holding `page_ids`."""
    positions = torch.arange(n)
    pages = torch.tensor(page_ids, dtype=torch.long)
    return (pages[positions // page_size] * page_size + positions % page_size).to(device)


def _stacked(layers: list[torch.Tensor], pool) -> torch.Tensor:
    if layers:
        return torch.stack(layers)
    return torch.empty((0, 2, 0, *pool.rows(0)[0].shape[1:]), dtype=pool.dtype)
