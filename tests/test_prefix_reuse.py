"""Prefix reuse on the embedded 270M (CPU): a prompt that starts after a cached prefix gives
the same bits as a cold prefill of the whole prompt: every new row's logits and the greedy
tokens after them, whether the prefix ends inside a page or on a page boundary, before or after
the ring wrapped, and while other requests evict cached pages around the pages it uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from muser import LLM, SamplingParams
from muser.runner import Runner

PAGE = 64


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(gguf_path, progress=False, device="cpu", max_num_seqs=4, max_model_len=1024,
               page_size=PAGE)


def _run(runner: Runner, ids: list[int], steps: int) -> tuple[int, torch.Tensor, list[int]]:
    """Prefill `ids` into a sequence allocated for them, then decode `steps` greedy tokens ->
    (rows it found cached, logits of every row it computed, the tokens); the sequence is freed
    (its end checkpointed)."""
    seq = runner.allocate(ids)
    try:
        reused = seq.num_cached
        rows = [runner.forward([seq], [ids[reused:]], all_logits=True).clone()]
        tokens = [int(rows[0][-1].argmax())]
        for _ in range(steps):
            rows.append(runner.forward([seq], [tokens[-1:]]).clone())
            tokens.append(int(rows[-1][-1].argmax()))
        return reused, torch.cat(rows), tokens
    finally:
        runner.free(seq)


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
    _run(runner, llm.encode("Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. " * 8), 0)
    reused, hit, hit_tokens = _run(runner, follow, 8)
    assert reused == len(first) - 1 and runner.prefix.stats().tokens_reused == reused
    assert (reused % PAGE != 0) == (reused > llm.model_config.sliding_window)
    runner.prefix.reset(runner.pages)
    cold_reused, cold, cold_tokens = _run(runner, follow, 8)
    assert cold_reused == 0 and runner.prefix.stats().hits == 0
    assert torch.equal(hit, cold[reused:]) and hit_tokens == cold_tokens
