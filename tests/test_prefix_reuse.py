"""Prefix reuse on the embedded 270M (CPU): a prompt that starts after a cached prefix gives
the same bits as a cold prefill of the whole prompt: every new row's logits and the greedy
tokens after them, whether the prefix ends inside a page or on a page boundary, before or after
the ring wrapped, and while other requests evict cached pages around the pages it uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from muser import LLM, SamplingParams
from muser.kvcache.prefix import chain_keys
from muser.kvcache.reuse import CHECKPOINT_EVERY
from tests.prefix_runs import run_and_decode

PAGE = 64


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(gguf_path, progress=False, device="cpu", max_num_seqs=4, max_model_len=1024,
               page_size=PAGE)


def _first_turn(llm: LLM, text: str, num_prompt: int, max_tokens: int) -> list[int]:
    """A first turn of `num_prompt` tokens through the engine -> prompt + outputs (the
    sequence ends before the last output, which was never fed back)."""
    llm.runner.prefix.reset(llm.runner.pages)
    ids = llm.encode(text * 200)[:num_prompt]
    return ids + llm.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)).token_ids


@pytest.mark.parametrize("num_prompt, max_tokens", [
    (601, 8),  # ends at 608 - 1 = 607: inside a page, after the 512-row ring wrapped
    (121, 8),  # ends at 128: on a page boundary, the ring not wrapped
])
def test_a_prefix_hit_gives_the_bits_of_a_cold_prefill(
        llm: LLM, num_prompt: int, max_tokens: int) -> None:
    first = _first_turn(llm, "The tide came in over the stones. ", num_prompt, max_tokens)
    follow = first + llm.encode(" Then the lighthouse keeper wrote it down.")[1:]
    runner = llm.runner
    # NOTE: another prompt in between takes the slot and the page the first turn freed
    run_and_decode(runner, llm.encode("Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. " * 8), 0)
    reused, hit, hit_tokens = run_and_decode(runner, follow, 8)
    assert reused == len(first) - 1 and runner.prefix.stats().tokens_reused == reused
    assert (reused % PAGE != 0) == (reused > llm.model_config.sliding_window)
    runner.prefix.reset(runner.pages)
    cold_reused, cold, cold_tokens = run_and_decode(runner, follow, 8)
    assert cold_reused == 0 and runner.prefix.stats().hits == 0
    assert torch.equal(hit, cold[reused:]) and hit_tokens == cold_tokens


@pytest.mark.parametrize("num_prompt", [
    50,  # inside its first page, the ring not wrapped
    128,  # on a page boundary: the page that holds the last row is copied, not shared
    601,  # inside a page, after the 512-row ring wrapped
    640,  # on a page boundary, after the ring wrapped
])
def test_the_same_prompt_again_resumes_before_its_last_token(llm: LLM, num_prompt: int) -> None:
    """A prompt sent twice: the second starts from the first's checkpoint at its prompt's end,
    one row before it (whose logits are needed), with the bits of a cold prefill; the row it
    computes again lands in a page of its own, never in one it shares."""
    runner = llm.runner
    runner.prefix.reset(runner.pages)
    ids = llm.encode("The tide came in over the stones. " * 200)[:num_prompt]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = llm.engine.add_request(ids, params)
    list(llm.engine.run(first))
    again = llm.engine.add_request(ids, params)
    list(llm.engine.run(again))
    assert first.num_reused == 0 and again.num_reused == num_prompt - 1
    seq = runner.allocate(ids)
    try:
        cached = runner.pages.lookup(chain_keys(ids, PAGE))
        assert seq.num_cached == num_prompt - 1 and seq.page_ids[-1] not in cached
        assert len(seq.page_ids) == -(-num_prompt // PAGE)
    finally:
        runner.free(seq)
    reused, hit, hit_tokens = run_and_decode(runner, ids, 8)
    assert reused == num_prompt - 1
    runner.prefix.reset(runner.pages)
    cold_reused, cold, cold_tokens = run_and_decode(runner, ids, 8)
    assert cold_reused == 0 and torch.equal(hit, cold[reused:]) and hit_tokens == cold_tokens


def test_eviction_under_pressure_spares_the_pages_a_sequence_shares(gguf_path: Path) -> None:
    """A 24-page pool of 16 rows: a follow-up shares 5 cached pages of its first turn while two
    other prompts need more pages than are free, so the other cached pages are evicted (and a
    sequence preempted) around it. Every request still gets the tokens it gets alone, cold."""
    llm = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=3, max_model_len=256,
              page_size=16, num_pages=24)
    engine, runner = llm.engine, llm.runner
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = llm.encode("The tide came in over the stones. " * 20)[:90]
    decoy = llm.encode("Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. " * 8)[:40]
    others = [llm.encode(f"{word} went down to the harbour at dawn. " * 20)[:150]
              for word in ("Anna", "Boris")]

    def seed() -> list[int]:
        runner.prefix.reset(runner.pages)
        outs = llm.generate(first, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids
        llm.generate(decoy, SamplingParams(max_tokens=2, ignore_eos=True))
        return first + outs + llm.encode(" The keeper wrote it down.")[1:]

    follow = seed()
    prompts = [follow, *others]
    alone = []
    for ids in prompts:
        runner.prefix.reset(runner.pages)
        alone.append(llm.generate(ids, params).token_ids)
    seed()
    assert runner.pages.num_cached == 5 + 2  # first turn: 93 rows; decoy: 41
    reqs = [engine.add_request(ids, params) for ids in prompts]
    tokens: dict[int, list[int]] = {r.uid: [] for r in reqs}
    evicted_while_shared = 0
    while engine.has_work:
        before = runner.pages.num_evictions
        outs = engine.step()
        shares = engine.live.get(reqs[0].uid)
        if shares is not None and runner.pages.num_evictions > before:
            evicted_while_shared += 1
        for out in outs:
            if out.token_id is not None:
                tokens[out.uid].append(out.token_id)
    assert reqs[0].num_reused == len(first) + 3 and evicted_while_shared >= 1
    assert [tokens[r.uid] for r in reqs] == alone
    assert engine.scheduler.stats.preemptions >= 1 and runner.pages.num_free == 24
    seq = runner.allocate(decoy + [2])  # the decoy's pages were evicted: nothing to reuse
    assert seq.num_cached == 0
    runner.free(seq)


def test_no_prefix_cache_computes_every_row(gguf_path: Path) -> None:
    llm = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=1, max_model_len=256,
              prefix_cache=False)
    ids = llm.encode("The tide came in over the stones. " * 5)
    first = llm.generate(ids, SamplingParams(max_tokens=2)).token_ids
    req = llm.engine.add_request(ids + first, SamplingParams(max_tokens=1))
    list(llm.engine.run(req))
    assert llm.runner.prefix is None and req.num_reused == 0
    assert llm.runner.memory.prefix_cache == 0 and llm.runner.pages.num_cached == 0


def test_a_shared_first_part_resumes_from_a_chunk_boundary(llm: LLM) -> None:
    """Two prompts that share their first 600 tokens (a system prompt): the second resumes
    from the first one's checkpoint after its 512-row chunk, with the bits of a cold prefill."""
    runner = llm.runner
    runner.prefix.reset(runner.pages)
    system = llm.encode("You are the lighthouse keeper's log. " * 80)[:600]
    llm.generate(system + llm.encode(" Who came by today?")[1:], SamplingParams(max_tokens=1))
    question = system + llm.encode(" What was the weather like?")[1:]
    reused, hit, _ = run_and_decode(runner, question, 2)
    assert reused == llm.config.prefill_chunk == CHECKPOINT_EVERY == 512
    runner.prefix.reset(runner.pages)
    cold_reused, cold, _ = run_and_decode(runner, question, 2)
    assert cold_reused == 0 and torch.equal(hit, cold[reused:])


@pytest.mark.parametrize("widths, reused", [
    ([256, 256, 88], 512),  # narrower chunks (a step beside decodes): a checkpoint at 512
    ([384, 216], 0),  # no chunk ends at 512: the first part is computed again
    ([600], 0),  # one wide chunk (a GPU's lone prompt) holds 512 inside it: no checkpoint
])
def test_checkpoints_fall_where_a_chunk_ends_on_a_multiple(llm: LLM, widths: list[int],
                                                           reused: int) -> None:
    """Where a first part is checkpointed does not depend on --prefill-chunk: after any
    multi-row chunk that ends at a multiple of CHECKPOINT_EVERY (and at a sequence's end)."""
    runner = llm.runner
    runner.prefix.reset(runner.pages)
    system = llm.encode("You are the lighthouse keeper's log. " * 80)[:600]
    first = system + llm.encode(" Who came by today?")[1:]
    seq = runner.allocate(first)
    try:
        at = 0
        for width in widths + [len(first) - sum(widths)]:
            runner.forward([seq], [first[at:at + width]])
            at += width
    finally:
        runner.free(seq)  # its end checkpointed: past the shared part, of no use below
    question = system + llm.encode(" What was the weather like?")[1:]
    assert run_and_decode(runner, question, 0)[0] == reused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_hit_gives_the_greedy_tokens_of_a_cold_prefill(gguf_path: Path) -> None:
    """Not bitwise on a GPU (the hit computes the rows after the prefix in another chunking
    than a cold prefill does): the 64 greedy tokens after a hit inside a page past the ring's
    wrap are the cold prefill's; the largest logit difference is printed."""
    llm = LLM(gguf_path, progress=False, device="cuda", max_num_seqs=2, max_model_len=1024,
              page_size=PAGE)
    first = _first_turn(llm, "The tide came in over the stones. ", 601, 8)
    follow = first + llm.encode(" Then the lighthouse keeper wrote it down.")[1:]
    runner = llm.runner
    reused, hit, hit_tokens = run_and_decode(runner, follow, 64)
    runner.prefix.reset(runner.pages)
    _, cold, cold_tokens = run_and_decode(runner, follow, 64)
    assert reused == len(first) - 1 and hit_tokens == cold_tokens
    print(f"max |logit difference| hit vs cold: {float((hit - cold[reused:]).abs().max()):.4f}")
