"""A sequence's greedy tokens and logits do not depend on what else shares its steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from muser import LLM, SamplingParams
from muser.engine import Engine
from muser.scheduler import Scheduler

MAX_TOKENS = 16
PROMPT_REPEATS = (60, 2, 9, 20, 30, 5, 14, 1)  # 10..~600 tokens: rings partial and wrapped
ARRIVAL_STEPS = (0, 0, 2, 3, 5, 6, 8, 9)


class _Recorder:
    """Wraps the engine's sampler to keep the logits of its last call (row i: the step's
    output i)."""

    def __init__(self, sampler) -> None:
        self.sampler, self.last = sampler, None

    def __call__(self, logits: torch.Tensor, rows: list, bitmask=None) -> list[int]:
        return self.choose(logits, rows, bitmask).tokens

    def choose(self, logits: torch.Tensor, rows: list, bitmask=None):
        return self.launch(logits, rows, bitmask).result()

    def launch(self, logits: torch.Tensor, rows: list, bitmask=None):
        self.last = logits.float().cpu().clone()
        return self.sampler.launch(logits, rows, bitmask)


def _add(engine: Engine, ids: list[int]) -> int:
    return engine.add_request(ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)).uid


def _run(engine: Engine, prompts: list[list[int]], arrivals: tuple[int, ...]
         ) -> tuple[list[list[int]], list[list[torch.Tensor]], int, int]:
    """Feed prompt i at engine step arrivals[i] -> (tokens, logits rows, widest decode pass,
    most requests in flight at once)."""
    tokens: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    index, step, widest, most_live = {}, 0, 0, 0
    if not isinstance(engine.sampler, _Recorder):
        engine.sampler = _Recorder(engine.sampler)
    while len(index) < len(prompts) or engine.has_work:
        for i in range(len(prompts)):
            if arrivals[i] == step:
                index[_add(engine, prompts[i])] = i
        widest = max(widest, len(engine.scheduler.decode_ready))
        most_live = max(most_live, len(engine.live))
        for k, out in enumerate(engine.step()):
            tokens[index[out.uid]].append(out.token_id)
            rows[index[out.uid]].append(engine.sampler.last[k])
        step += 1
    return tokens, rows, widest, most_live


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(gguf_path, progress=False, device="cpu", max_num_seqs=8, max_model_len=2048)


def _alone_and_together(engine: Engine, prompts: list[list[int]]) -> tuple[bool, list[float]]:
    """-> (tokens identical?, max |logit difference| per emitted token of every sequence)."""
    alone = [_run(engine, [p], (0,)) for p in prompts]
    together, rows, widest, most_live = _run(engine, prompts, ARRIVAL_STEPS)
    assert most_live == 8 and widest >= 6
    diffs = [float((a[1][0][k] - rows[i][k]).abs().max())
             for i, a in enumerate(alone) for k in range(MAX_TOKENS)]
    return together == [a[0][0] for a in alone], diffs


def _prompts(llm: LLM) -> list[list[int]]:
    prompts = [llm.encode("Tell me about the sea and the stars. " * n) for n in PROMPT_REPEATS]
    assert min(map(len, prompts)) < 16 and max(map(len, prompts)) > llm.model_config.sliding_window
    return prompts


def test_logits_alone_are_bitwise_the_logits_alongside_seven_others(llm: LLM) -> None:
    """The default adaptive policy: a prompt prefilled beside running streams is cut into
    narrower chunks than alone, and its logits are still the same bits (muser.ops.cpu)."""
    same_tokens, diffs = _alone_and_together(llm.engine, _prompts(llm))
    assert same_tokens
    assert max(diffs) == 0.0, f"{sum(d > 0 for d in diffs)}/{len(diffs)} rows differ"


@pytest.mark.slow
def test_fixed_chunks_make_logits_bitwise_batch_independent(llm: LLM) -> None:
    engine = Engine(llm.runner, llm.tokenizer, Scheduler(8, adaptive=False))
    same_tokens, diffs = _alone_and_together(engine, _prompts(llm))
    assert same_tokens and max(diffs) == 0.0


def _decode_logits(llm: LLM, prompts: list[list[int]], steps: int) -> list[list[torch.Tensor]]:
    """Prefill each prompt alone in one call, then decode all of them together greedily."""
    runner = llm.runner
    seqs = [runner.allocate() for _ in prompts]
    try:
        last = [int(runner.forward([s], [p])[0].argmax()) for s, p in zip(seqs, prompts)]
        rows: list[list[torch.Tensor]] = [[] for _ in prompts]
        for _ in range(steps):
            logits = runner.forward(seqs, [[t] for t in last]).float()
            for i, row in enumerate(logits):
                rows[i].append(row.clone())
            last = [int(row.argmax()) for row in logits]
        return rows
    finally:
        for s in seqs:
            runner.free(s)


def test_decode_batching_leaves_logits_bitwise_unchanged(llm: LLM) -> None:
    prompts = [llm.encode("Tell me about the sea and the stars. " * n) for n in PROMPT_REPEATS[:4]]
    batched = _decode_logits(llm, prompts, 6)
    for i in (0, 1):
        alone = _decode_logits(llm, [prompts[i]], 6)[0]
        assert all(torch.equal(a, b) for a, b in zip(alone, batched[i])), i


def test_a_one_row_first_chunk_beside_other_chunks(llm: LLM) -> None:
    """The budget can leave a prompt one row of a step: a one-row chunk with nothing cached,
    after another chunk (not in the decode group), gives the logits it gives alone."""
    runner = llm.runner
    long, short = llm.encode("Tell me about the sea and the stars. " * 3), [2, 1017, 563]
    alone = runner.allocate()
    try:
        first = [runner.forward([alone], [[t]])[0].clone() for t in short]
    finally:
        runner.free(alone)
    a, b = runner.allocate(), runner.allocate()
    try:
        together = [runner.forward([a, b], [long, short[:1]])[1].clone()]
        together += [runner.forward([b], [[t]])[0].clone() for t in short[1:]]
    finally:
        runner.free(a)
        runner.free(b)
    assert all(torch.equal(x, y) for x, y in zip(first, together))
