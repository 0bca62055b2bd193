"""n samples of one prompt on the embedded 270M (CPU): the prompt is prefilled once, the samples
fork from it (full pages shared by reference, partial page and rings copied), and sample i
draws exactly what a request of its own seeded seed + i draws (the CPU backend's rows do not
depend on batching or chunking, so a fork's KV has the bits of a cold prefill)."""

from __future__ import annotations

from pathlib import Path

import pytest

from muser import LLM, SamplingParams
from muser.core import StepOutput
from muser.engine import Engine

PAGE = 64


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(gguf_path, progress=False, device="cpu", max_num_seqs=4, max_model_len=1024,
               page_size=PAGE, num_threads=2)


def _drive(engine: Engine, prompt_ids: list[int], params: SamplingParams, uid: int,
           on_step=None) -> dict[int, list[StepOutput]]:
    """Run one request to its end -> its outputs per sample index."""
    engine.add(engine.make_request(prompt_ids, params, uid=uid))
    outs: dict[int, list[StepOutput]] = {}
    while engine.has_work:
        for out in engine.step():
            assert out.uid == uid
            outs.setdefault(out.index, []).append(out)
        if on_step is not None:
            on_step(engine)
    return outs


def _tokens(outs: list[StepOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


@pytest.mark.parametrize("num_prompt", [150, 600])  # a partial page; the 512-row ring wrapped
def test_each_sample_draws_what_its_own_seeded_request_draws(llm: LLM, num_prompt: int) -> None:
    engine = llm.engine
    ids = llm.encode("A lighthouse keeper counted the ships that passed. " * 80)[:num_prompt]
    params = SamplingParams(max_tokens=4, temperature=2.0, seed=11, n=3, ignore_eos=True)
    shared: list[list[int]] = []

    def pages_after_fork(eng: Engine) -> None:
        if not shared and len(eng.live) == 3:
            shared.extend(seq.page_ids for seq in eng.live.values())

    engine.runner.prefix.reset(engine.runner.pages)  # NOTE: a shorter case cached its prefix
    before = engine.scheduler.stats.rows["prefill"]
    outs = _drive(engine, ids, params, 1000, pages_after_fork)
    assert engine.scheduler.stats.rows["prefill"] - before == num_prompt  # prefilled once
    assert sorted(outs) == [0, 1, 2]
    assert [o.ends_request for i in outs for o in outs[i] if o.finished].count(True) == 1
    full = num_prompt // PAGE
    assert len({tuple(p[:full]) for p in shared}) == 1  # the prompt's full pages, shared
    assert len({p[full] for p in shared}) == 3  # each sample its own partial page
    for index in range(3):
        alone = _drive(engine, ids, SamplingParams(max_tokens=4, temperature=2.0,
                                                   seed=11 + index, ignore_eos=True),
                       2000 + index)
        assert _tokens(outs[index]) == _tokens(alone[0]), index
    assert len({tuple(_tokens(o)) for o in outs.values()}) > 1  # the seeds differ


def test_abort_cancels_every_sample_and_frees_their_pages(llm: LLM) -> None:
    engine = llm.engine
    free = engine.runner.pages.num_free
    ids = llm.encode("Count slowly: one, two, three, four, five, six, seven. " * 12)
    engine.add(engine.make_request(ids, SamplingParams(max_tokens=50, n=4, ignore_eos=True),
                                   uid=3000))
    while len(engine.live) < 4:
        engine.step()
    engine.step()
    out = engine.abort(3000)
    assert out is not None and out.finish_reason == "cancelled" and out.ends_request
    assert not engine.live and not engine.forks and not engine.scheduler.has_work
    assert engine.runner.pages.num_free == free
    assert len(engine.runner.free_slots) == 4


def test_greedy_samples_are_one_text_with_logprobs_per_sample(llm: LLM) -> None:
    ids = llm.encode("The capital of France is")
    outs = _drive(llm.engine, ids, SamplingParams(max_tokens=5, n=2, logprobs=2), 4000)
    assert _tokens(outs[0]) == _tokens(outs[1])
    for index in (0, 1):
        for o in outs[index]:
            if o.token_id is not None:
                assert o.logprobs.top[0][0] == o.token_id  # greedy: the best token
                assert o.logprobs.logprob == o.logprobs.top[0][1]
