"""The prefix cache's host tier on the embedded 270M (CPU): with a device pool too small to keep
a first turn, what it evicts goes to the host tier and comes back by copy, with the tokens and
the bits (torch.equal logits) the same prompts get with ample device memory; and the host tier
keeps within its own bound, dropping its oldest entries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from muser import LLM
from tests.prefix_runs import run_and_decode

PAGE = 16
SMALL = {"num_pages": 12, "prefix_cache_gb": 0.02, "kv_host_gb": 0.1}  # one device checkpoint


def _llm(gguf_path: Path, **memory) -> LLM:
    return LLM(gguf_path, progress=False, device="cpu", max_num_seqs=2, max_model_len=256,
               page_size=PAGE, **memory)


@pytest.fixture(scope="module")
def small(gguf_path: Path) -> LLM:
    return _llm(gguf_path, **SMALL)


def _turns(llm: LLM) -> list[tuple[int, torch.Tensor, list[int]]]:
    """A first turn (94 rows: 6 pages), another prompt (10 pages), then the first turn
    continued."""
    runner = llm.runner
    runner.prefix.reset(runner.pages)
    first = llm.encode("The tide came in over the stones. " * 20)[:90]
    other = llm.encode("Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. " * 20)[:150]
    a = run_and_decode(runner, first, 4)
    b = run_and_decode(runner, other, 2)
    follow = first + a[2][:4] + llm.encode(" Then the keeper wrote it down.")[1:]
    return [a, b, run_and_decode(runner, follow, 8)]


def test_a_hit_from_the_host_tier_gives_the_bits_of_ample_device_memory(
        gguf_path: Path, small: LLM) -> None:
    """12 pages of 16 rows and one checkpoint on the device: the other prompt evicts 3 of the
    first turn's 5 cached pages and its checkpoint, which the continued turn copies back from
    the host. With 64 pages and a 1 GB store nothing is evicted; both give the same bits."""
    tiny = _turns(small)
    stats = small.runner.prefix.stats()
    assert stats.page_evictions >= 3 and stats.checkpoint_evictions >= 1
    assert stats.hits == stats.host_hits == 1 and tiny[2][0] == 94
    # NOTE: back from the host: 3 pages and one checkpoint (the store's one row: rings + page)
    page_nbytes = small.runner.pool.page_nbytes
    assert stats.host.copied_bytes["to_device"] == (
        3 * page_nbytes + small.runner.prefix.store.nbytes)
    ample_llm = _llm(gguf_path, num_pages=64)
    ample = _turns(ample_llm)
    ample_stats = ample_llm.runner.prefix.stats()
    assert ample_stats.page_evictions == ample_stats.checkpoint_evictions == 0
    assert ample_stats.hits == 1 and ample_stats.host_hits == 0 and ample_stats.host is None
    for (reused, logits, tokens), (ample_reused, ample_logits, ample_tokens) in zip(tiny, ample):
        assert reused == ample_reused and tokens == ample_tokens
        assert torch.equal(logits, ample_logits)


def test_a_host_hit_with_no_page_free_is_a_miss(small: LLM) -> None:
    """The continued turn needs pages for what it copies back: while another sequence holds
    every page it starts cold (nothing taken off the host); once they are free, it hits."""
    runner = small.runner
    first = _turns(small)[0]
    ids = small.encode("The tide came in over the stones. " * 20)[:90] + first[2][:4]
    holder = runner.allocate()
    runner.reserve(holder, runner.pages.num_pages * PAGE)  # every page (the cached ones spill)
    before = runner.prefix.stats()
    seq = runner.allocate(ids + [2])
    assert seq.num_cached == 0 and runner.prefix.stats().hits == before.hits
    assert runner.prefix.stats().host.nbytes == before.host.nbytes
    runner.free(seq)
    runner.free(holder)
    assert runner.pages.num_free == runner.pages.num_pages
    assert run_and_decode(runner, ids + [2], 0)[0] == 94
    assert runner.prefix.stats().host_hits == before.host_hits + 1


def test_the_host_tier_keeps_its_bound_and_drops_its_oldest(small: LLM) -> None:
    """Eight short prompts, each pushing the previous one's checkpoint off the one-checkpoint
    device store: the 0.1 GiB tier holds six of them (16 MB each, and the pages the device
    evicted), so the oldest prompt finds nothing while the later ones come back from the host."""
    runner = small.runner
    runner.prefix.reset(runner.pages)
    prompts = [small.encode(f"{word} walked down to the harbour at dawn. " * 8)[:40]
               for word in ("Anna", "Boris", "Clara", "Dmitri", "Elena", "Femi", "Greta", "Hugo")]
    ends = []
    for ids in prompts:
        ends.append(ids + run_and_decode(runner, ids, 1)[2][:1])
        host = runner.prefix.stats().host
        assert host.nbytes <= host.capacity_bytes
    host = runner.prefix.stats().host
    assert host.checkpoints == 6 and host.evictions["checkpoint"] == 1
    cached = [runner.prefix.cached_tokens(ids + [2]) for ids in ends]
    assert cached == [0] + [41] * 7  # the last one's checkpoint is on the device
    hits = runner.prefix.stats().host_hits
    assert run_and_decode(runner, ends[-2] + [2], 0)[0] == 41
    assert runner.prefix.stats().host_hits == hits + 1
