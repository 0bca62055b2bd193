"""Prefix reuse: a prompt that begins with a prefix computed before starts after it.

    on free ....... the sequence's full pages are registered under their prefix keys (they
                    stay cached, evicted LRU only when free pages run out), and its state at
                    its end is checkpointed: every sliding layer's ring (rows + metadata) and
                    the rows of its partial last page (muser/kvcache/prefix.py); so is its
                    state where its prompt ends, and after a prefill chunk that ends at a
                    multiple of CHECKPOINT_EVERY tokens, whatever the chunk's width (the
                    runner's call)
    on allocate ... the longest checkpoint whose prefix the prompt begins with and whose full
                    pages are still cached: those pages are shared (reference counted,
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
from muser.kvcache.pages import OutOfPages, PageAllocator
from muser.kvcache.placement import Placement
from muser.kvcache.pool import KVPool
from muser.kvcache.prefix import ROOT, CheckpointIndex, PrefixStats, chain_keys

# NOTE: a prompt that shares only a first part with an earlier one (a system prompt) resumes
# from the last checkpoint inside that part. Checkpoints are taken where a chunk ends, so their
# spacing is a multiple of this: the CPU's 512-row chunks end on every one, a GPU's 2,048-row
# chunks of a lone prompt on every fourth, and the narrower chunks of a step beside decodes
# (--decode-waiting-chunk) again on every one.
CHECKPOINT_EVERY = 512


class PrefixCache:
    def __init__(self, pool: KVPool, pages: PageAllocator, budget_bytes: int,
                 max_checkpoints: int) -> None:
        """budget_bytes: what the checkpoint store may take (as many whole checkpoints as fit,
        at most max_checkpoints)."""
        self.page_size = pool.page_size
        fits = max(budget_bytes, 0) // checkpoint_nbytes(pool)
        self.store = CheckpointStore(pool, min(fits, max_checkpoints))
        self.reset(pages)

    def reset(self, pages: PageAllocator) -> None:
        """Forget every prefix (the runner remade its pages, or the warm-up is over)."""
        self.pages = pages
        pages.forget()
        self.index = CheckpointIndex(self.store.rings.shape[0])
        self._lookups = self._hits = self._reused = 0

    def stats(self) -> PrefixStats:
        return PrefixStats(self._lookups, self._hits, self._reused, len(self.index),
                           self.index.capacity, self.pages.num_cached, self.pages.num_evictions,
                           self.index.num_evictions)

    def _match(self, token_ids: list[int], touch: bool = True):
        """The longest cached prefix of token_ids -> (page keys, its pages, its checkpoint), or
        None."""
        ps, n = self.page_size, len(token_ids)
        if n < 2:
            return None
        keys = chain_keys(token_ids, ps)
        cached = self.pages.lookup(keys)
        for k in range(len(cached), -1, -1):
            ckpt = self.index.find(keys[k - 1] if k else ROOT, token_ids[k * ps:(k + 1) * ps],
                                   n - k * ps, touch)
            if ckpt is not None:
                return keys, cached[:k], ckpt
        return None

    def cached_tokens(self, token_ids: list[int]) -> int:
        """How many of token_ids a restore would reuse now (takes nothing): at most all but
        the last."""
        match = self._match(token_ids, touch=False)
        return min(match[2].num_tokens, len(token_ids) - 1) if match else 0

    def restore(self, seq: Placement, token_ids: list[int], count: bool = True) -> None:
        """Start fresh `seq` after the longest cached prefix of token_ids, if any, and before
        its last token at the latest (`count`: in the lookup / hit counters; a slot file's
        export is not a prompt)."""
        self._lookups += count
        match = self._match(token_ids, touch=count)
        if match is None:
            return
        keys, shared, ckpt = match
        n, ring = ckpt.num_tokens, ckpt.ring
        whole = n == len(token_ids)  # resumes at n - 1, computing the last row again
        copied = shared[-1] if whole and not ckpt.tail_ids else None  # holds row n - 1
        self.pages.share(shared)  # NOTE: first, so the tail page cannot evict one of them
        tail = []
        if ckpt.tail_ids or copied is not None:
            try:
                tail = self.pages.allocate(1)
            except OutOfPages:
                self.pages.free(shared)
                return
        self.store.restore(ckpt.index, seq.slot, tail[0] if ckpt.tail_ids else None)
        if copied is not None:
            self.store.pool.copy_page(copied, tail[0])
            self.pages.free([copied])
            shared = shared[:-1]
        if whole:
            n, ring = n - 1, ring.retract()
        seq.page_ids, seq.ring, seq.num_cached = shared + tail, ring, n
        seq.token_ids, seq.keys = token_ids[:n], keys[:len(shared)]
        self._hits += count
        self._reused += n if count else 0

    def forget(self, token_ids: list[int]) -> None:
        """Forget every cached prefix of `token_ids`: the checkpoints filed along it and the
        pages registered under its keys (a page a sequence holds stays with it), so that the
        same prompt computes all its rows again."""
        ps, keys = self.page_size, chain_keys(token_ids, self.page_size)
        for k, key in enumerate([ROOT, *keys]):
            for ckpt in self.index.under(key):
                if list(ckpt.tail_ids) == token_ids[k * ps:k * ps + len(ckpt.tail_ids)]:
                    self.index.remove(ckpt.key, ckpt.tail_ids)
        for key in keys:
            self.pages.unregister(key)

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
