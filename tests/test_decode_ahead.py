"""Decode ahead (muser/engine/ahead.py): the next decode step queued before the tokens it is fed
reach the host. On a GPU that overlaps the host's work with the device's; here, on the CPU
(where it is off by default and runs eagerly), the same bookkeeping is checked against the
engine without it: the same tokens, texts, logprobs and finish reasons, every page back, and a
prefix cache left by a sequence that stopped with a row computed ahead reusable exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from muser import LLM, SamplingParams
from muser.runner import Runner

PARAMS = [
    SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True),  # greedy, logprobs
    SamplingParams(max_tokens=9, temperature=0.8, top_k=40, seed=7),  # seeded draws
    SamplingParams(max_tokens=3, ignore_eos=True),  # ends by length early
    SamplingParams(max_tokens=16, repeat_penalty=1.3, presence_penalty=0.5),  # host history
]
PROMPTS = ["The tide came in over the stones and", "Write a list of three rivers:",
           "Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(gguf_path, progress=False, device="cpu", max_num_seqs=5, max_model_len=256,
               page_size=16, prefix_cache=False)


@pytest.fixture
def ahead_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many sequences each step launched ahead carried (Runner.forward_ahead, spied)."""
    calls: list[int] = []
    real = Runner.forward_ahead

    def spy(self, seqs, tokens):
        calls.append(len(seqs))
        return real(self, seqs, tokens)

    monkeypatch.setattr(Runner, "forward_ahead", spy)
    return calls


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams]], ahead: bool,
        abort_after: dict[int, int] | None = None) -> list[list[tuple]]:
    """Serve the requests together -> per request, its outputs (token, text, finish reason,
    logprobs); abort_after: request index -> abort it after that many outputs."""
    engine = llm.engine
    engine.decode_ahead = ahead
    free = engine.runner.pages.num_free
    reqs = [engine.add_request(ids, p) for ids, p in requests]
    at = {r.uid: i for i, r in enumerate(reqs)}
    outs: list[list[tuple]] = [[] for _ in reqs]
    while engine.has_work:
        for out in engine.step():
            i = at[out.uid]
            outs[i].append((out.token_id, out.text_delta, out.finish_reason, out.logprobs))
            if abort_after and abort_after.get(i) == len(outs[i]) and not out.finished:
                out = engine.abort(out.uid)
                outs[i].append((out.token_id, out.text_delta, out.finish_reason, out.logprobs))
    assert engine.runner.pages.num_free == free and not engine.ahead
    return outs


def test_decode_ahead_changes_no_output(llm: LLM, ahead_steps: list[int]) -> None:
    requests = [(llm.encode(t), p) for t, p in zip(PROMPTS, PARAMS)]
    requests.append((llm.encode("Count: one, two,"), SamplingParams(max_tokens=40,
                                                                   stop=(" five",))))
    plain = run(llm, requests, ahead=False)
    assert not ahead_steps
    ahead = run(llm, requests, ahead=True)
    assert ahead == plain
    assert [o[-1][2] for o in plain] == ["length", "length", "length", "length", "stop"]
    # NOTE: from the first decode step on, every sequence not ending by length went ahead
    assert len(ahead_steps) >= 10 and ahead_steps[0] == 5


def test_an_abort_while_a_step_runs_ahead(llm: LLM, ahead_steps: list[int]) -> None:
    requests = [(llm.encode(t), SamplingParams(max_tokens=14, ignore_eos=True))
                for t in PROMPTS[:3]]
    plain = run(llm, requests, ahead=False, abort_after={1: 5})
    ahead = run(llm, requests, ahead=True, abort_after={1: 5})
    assert ahead == plain and ahead_steps
    assert len(ahead[1]) == 6 and ahead[1][-1][2] == "cancelled"


def test_a_tiny_page_pool_with_decode_ahead(gguf_path: Path, ahead_steps: list[int]) -> None:
    """Pages taken by a step launched ahead are counted, preemption still recomputes exactly."""
    llm = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=3, max_model_len=256,
              page_size=16, num_pages=16, decode_ahead=True)
    prompts = [llm.encode("The tide came in over the stones. " * n) for n in (9, 10, 11)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = [[o[0] for o in run(llm, [(p, params)], ahead=False)[0]] for p in prompts]
    llm.runner.prefix.reset(llm.runner.pages)  # NOTE: else the prompts resume, cached alone
    together = run(llm, [(p, params) for p in prompts], ahead=True)
    assert [[o[0] for o in outs] for outs in together] == alone
    assert llm.engine.scheduler.stats.preemptions >= 1 and ahead_steps


def test_a_prefix_left_by_a_stop_computed_ahead_reuses_exactly(gguf_path: Path,
                                                               ahead_steps: list[int]) -> None:
    """A sequence stopped by a stop string had its stopping token's row computed ahead, and its
    final checkpoint holds that row too: a follow-up that carries the whole turn on (as a chat
    template carries the end-of-turn token on) resumes one row later than without decode ahead,
    and gets exactly the tokens computed from scratch."""
    llm = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=2, max_model_len=256,
              page_size=16, decode_ahead=True)
    first = llm.encode("The tide came in over the stones. " * 5 + "Count: one, two,")
    stop = SamplingParams(max_tokens=40, stop=(" five",))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reused = {}
    for ahead in (False, True):
        llm.engine.runner.prefix.reset(llm.engine.runner.pages)
        steps = len(ahead_steps)
        done = run(llm, [(first, stop)], ahead=ahead)[0]
        assert done[-1][2] == "stop" and (len(ahead_steps) > steps) == ahead
        follow = first + [o[0] for o in done] + llm.encode(" and then")[1:]
        req = llm.engine.add_request(follow, params)
        out = [o.token_id for o in llm.engine.run(req)]
        reused[ahead] = req.num_reused
    assert reused == {False: len(first) + len(done) - 1, True: len(first) + len(done)}
    fresh = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=1, max_model_len=256,
                page_size=16, prefix_cache=False).generate(follow, params)
    assert out == fresh.token_ids


def test_the_first_decode_step_goes_ahead_from_the_prompts_last_chunk(
        gguf_path: Path, ahead_steps: list[int]) -> None:
    """The step that ends a prompt (its last chunk of several) queues the first decode step
    ahead: every token after the first is computed ahead, with the same outputs as without."""
    llm = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=2, max_model_len=256,
              page_size=16, prefill_chunk=16, prefix_cache=False)
    prompt = llm.encode("The tide came in over the stones. " * 5)
    assert len(prompt) > 2 * 16
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = run(llm, [(prompt, params)], ahead=False)
    ahead = run(llm, [(prompt, params)], ahead=True)
    assert ahead == plain and len(ahead[0]) == 6
    assert ahead_steps == [1] * 5
