"""Prefix reuse: a prompt that begins with a prefix computed before starts after it.

    on free ....... the sequence's full pages are registered under their prefix keys (they
                    stay cached, evicted LRU only when free pages run out), and its state at
                    its end is checkpointed: every sliding layer's ring (rows + metadata) and
                    the rows of its partial last page (muser/kvcache/prefix.py); so is its
                    state where its prompt ends, and after a prefill chunk that ends at a
                    multiple of CHECKPOINT_EVERY tokens, whatever the chunk's width (the
                    runner's call)
    on evict ...... with a host tier (--kv-host-gb, muser/kvcache/host_tier.py), a cached page
                    or a checkpoint the device evicts is copied to host memory first
    on allocate ... the longest checkpoint whose prefix the prompt begins with and whose full
                    pages are still cached (on the device, or the host: copied back into new
                    pages and the checkpoint store): those pages are shared (reference counted,
                    read-only), the partial page's rows are copied into a new page of the
                    sequence, the rings are copied back into its slot; it resumes at that
                    position. A checkpoint of the whole prompt (the same prompt again) resumes
                    one row before its end, whose logits are needed: the ring gives back its
                    newest row (RingState.retract) and the row's page is the sequence's own
                    (a page the row fills is copied, not shared), so computing the row again
                    writes it where it was

The K/V rows a sequence computes do not depend on how its rows were chunked (the CPU
backend's exactness construction), so a hit gives the same bits as a cold prefill there.
"""

from __future__ import annotations

from muser.kvcache.checkpoints import CheckpointStore, checkpoint_nbytes
from muser.kvcache.host_tier import Held, HostTier
from muser.kvcache.pages import PageAllocator
from muser.kvcache.placement import Placement
from muser.kvcache.pool import KVPool
from muser.kvcache.prefix import ROOT, Checkpoint, CheckpointIndex, PrefixStats, chain_keys

# NOTE: a prompt that shares only a first part with an earlier one (a system prompt) resumes
# from the last checkpoint inside that part. Checkpoints are taken where a chunk ends, so their
# spacing is a multiple of this: the CPU's 512-row chunks end on every one, a GPU's 2,048-row
# chunks of a lone prompt on every fourth, and the narrower chunks of a step beside decodes
# (--decode-waiting-chunk) again on every one.
CHECKPOINT_EVERY = 512


class PrefixCache:
    def __init__(self, pool: KVPool, pages: PageAllocator, budget_bytes: int,
                 max_checkpoints: int, host_bytes: int = 0) -> None:
        """budget_bytes: what the checkpoint store may take (as many whole checkpoints as fit,
        at most max_checkpoints); host_bytes: the host tier's bound (0: none, what the device
        evicts is dropped)."""
        self.page_size = pool.page_size
        fits = max(budget_bytes, 0) // checkpoint_nbytes(pool)
        self.store = CheckpointStore(pool, min(fits, max_checkpoints))
        self.host = HostTier(host_bytes, pool.pages[:, :, 0].shape, pool.dtype,
                             pool.rings.device) if host_bytes > 0 else None
        self.reset(pages)

    def reset(self, pages: PageAllocator) -> None:
        """Forget every prefix (the runner remade its pages, or the warm-up is over)."""
        self.pages = pages
        pages.forget()
        spill = self.host is not None
        pages.spill = self._spill_page if spill else None
        self.index = CheckpointIndex(self.store.rings.shape[0],
                                     self._spill_checkpoint if spill else None)
        if self.host is not None:
            self.host.clear()
        self._lookups = self._hits = self._host_hits = self._reused = 0

    def stats(self) -> PrefixStats:
        return PrefixStats(self._lookups, self._hits, self._reused, len(self.index),
                           self.index.capacity, self.pages.num_cached, self.pages.num_evictions,
                           self.index.num_evictions, self._host_hits,
                           self.host.stats() if self.host is not None else None)

    def _run(self, keys: list[bytes]) -> list[int | None]:
        """The longest run of keys[:n] cached on the device (its page) or on the host (None)."""
        if self.host is None:
            return self.pages.lookup(keys)
        run = []
        for key in keys:
            page = self.pages.page_of(key)
            if page is None and not self.host.has_page(key):
                break
            run.append(page)
        return run

    def _find(self, key: bytes, next_ids: list[int], max_tail: int,
              touch: bool) -> tuple[Checkpoint, bool] | None:
        """The longest checkpoint under `key` (CheckpointIndex.find), on the device or the host
        -> (it, whether it is on the host), or None; the device's when both hold one as long."""
        ckpt = self.index.find(key, next_ids, max_tail, touch=False)
        held = self.host.find(key, next_ids, max_tail) if self.host is not None else None
        if held is not None and (ckpt is None or held.num_tokens > ckpt.num_tokens):
            return held, True
        if ckpt is None:
            return None
        if touch:
            self.index.hit(ckpt)
        return ckpt, False

    def _match(self, token_ids: list[int], touch: bool = True):
        """The longest cached prefix of token_ids -> (page keys, its pages (None: on the host),
        its checkpoint, whether that is on the host), or None."""
        ps, n = self.page_size, len(token_ids)
        if n < 2:
            return None
        keys = chain_keys(token_ids, ps)
        run = self._run(keys)
        for k in range(len(run), -1, -1):
            found = self._find(keys[k - 1] if k else ROOT, token_ids[k * ps:(k + 1) * ps],
                               n - k * ps, touch)
            if found is not None:
                return keys, run[:k], *found
        return None

    def cached_tokens(self, token_ids: list[int]) -> int:
        """How many of token_ids a restore would reuse now (takes nothing): at most all but
        the last."""
        match = self._match(token_ids, touch=False)
        return min(match[2].num_tokens, len(token_ids) - 1) if match else 0

    def restore(self, seq: Placement, token_ids: list[int], count: bool = True) -> None:
        """Start fresh `seq` after the longest cached prefix of token_ids, if any, and before
        its last token at the latest (`count`: in the lookup / hit counters; a slot file's
        export is not a prompt). What the prefix needs from the host tier is copied back into
        new pages and the checkpoint store; with too few pages free for that, it is a miss."""
        self._lookups += count
        match = self._match(token_ids, touch=count)
        if match is None:
            return
        keys, run, ckpt, on_host = match
        whole = ckpt.num_tokens == len(token_ids)  # resumes at n - 1, computes that row again
        copy_last = whole and not ckpt.tail_ids  # the last shared page holds row n - 1
        on_device = [page for page in run if page is not None]
        self.pages.share(on_device)  # NOTE: first, so allocating cannot evict one of them
        num_back = len(run) - len(on_device)
        needed = num_back + (1 if ckpt.tail_ids or copy_last else 0)
        if needed > self.pages.num_free:
            self.pages.free(on_device)
            return
        # NOTE: taken off the host before pages are allocated: a page evicted then spills to
        # the host, whose LRU could drop rows still to be copied back
        host_pages = [self.host.take_page(key) for key, page in zip(keys, run) if page is None]
        held = self.host.take_checkpoint(ckpt) if on_host else None
        new = self.pages.allocate(needed)
        shared, tail = self._pages_back(keys, run, host_pages, new[:num_back]), new[num_back:]
        if held is not None:
            ckpt = self._checkpoint_back(held)
        self.store.restore(ckpt.index, seq.slot, tail[0] if ckpt.tail_ids else None)
        n, ring = ckpt.num_tokens, ckpt.ring
        if copy_last:
            self.store.pool.copy_page(shared[-1], tail[0])
            self.pages.free([shared[-1]])
            shared = shared[:-1]
        if whole:
            n, ring = n - 1, ring.retract()
        seq.page_ids, seq.ring, seq.num_cached = shared + tail, ring, n
        seq.token_ids, seq.keys = token_ids[:n], keys[:len(shared)]
        self._hits += count
        self._host_hits += count and (held is not None or num_back > 0)
        self._reused += n if count else 0

    def _pages_back(self, keys: list[bytes], run: list[int | None], host_pages: list[Held],
                    new: list[int]) -> list[int]:
        """Copy the run's pages taken off the host (`host_pages`, in order) into pages `new`,
        registered under their keys -> the run's pages, all on the device."""
        taken, new_pages, pages = iter(host_pages), iter(new), []
        for key, page in zip(keys, run):
            if page is None:
                page = next(new_pages)
                self.host.page_back(next(taken), self.store.pool.pages[:, :, page])
                self.pages.register(page, key)
            pages.append(page)
        return pages

    def _checkpoint_back(self, held: Held) -> Checkpoint:
        """Put a checkpoint taken off the host into the device store -> its device entry
        (protected: it was hit)."""
        h = held.ckpt
        ckpt = self.index.add(h.key, h.tail_ids, h.num_tokens, h.ring, protected=True)
        assert ckpt is not None, "a checkpoint the device holds is found there first"
        self.host.checkpoint_back(held, self.store.rings[ckpt.index], self.store.tails[ckpt.index])
        return ckpt

    def _spill_page(self, page: int, key: bytes) -> None:
        self.host.put_page(key, self.store.pool.pages[:, :, page])

    def _spill_checkpoint(self, ckpt: Checkpoint) -> None:
        self.host.put_checkpoint(ckpt, self.store.rings[ckpt.index],
                                 self.store.tails[ckpt.index] if ckpt.tail_ids else None)

    def forget(self, token_ids: list[int]) -> None:
        """Forget every cached prefix of `token_ids`: the checkpoints filed along it and the
        pages registered under its keys (a page a sequence holds stays with it), on the device
        and the host, so that the same prompt computes all its rows again."""
        ps, keys = self.page_size, chain_keys(token_ids, self.page_size)
        for k, key in enumerate([ROOT, *keys]):
            along = token_ids[k * ps:(k + 1) * ps]
            for ckpt in self.index.under(key):
                if list(ckpt.tail_ids) == along[:len(ckpt.tail_ids)]:
                    self.index.remove(ckpt.key, ckpt.tail_ids)
            for ckpt in self.host.under(key) if self.host is not None else ():
                if list(ckpt.tail_ids) == along[:len(ckpt.tail_ids)]:
                    self.host.forget_checkpoint(ckpt)
        for key in keys:
            self.pages.unregister(key)
            if self.host is not None:
                self.host.forget_page(key)

    def append(self, seq: Placement, token_ids: list[int]) -> None:
        """Record rows the sequence has just computed (their page keys as pages fill)."""
        seq.token_ids += token_ids
        done, full = len(seq.keys), len(seq.token_ids) // self.page_size
        if full > done:
            seq.keys += chain_keys(seq.token_ids[done * self.page_size:full * self.page_size],
                                   self.page_size, seq.keys[-1] if seq.keys else ROOT)

    def save(self, seq: Placement, final: bool = False) -> None:
        """Register the sequence's full pages and checkpoint its state now; `final`: at its
        prompt's end or its own, a protected checkpoint (see CheckpointIndex)."""
        n, ps = seq.num_cached, self.page_size
        if not n:
            return
        for page, key in zip(seq.page_ids, seq.keys):
            self.pages.register(page, key)
        k = n // ps
        ckpt = self.index.add(seq.keys[k - 1] if k else ROOT, tuple(seq.token_ids[k * ps:n]), n,
                              seq.ring, protected=final)
        if ckpt is not None:
            self.store.save(ckpt.index, seq.slot, seq.page_ids[k] if ckpt.tail_ids else None)
