"""Sampling filters, repetition penalty, seeds and stop strings."""

from __future__ import annotations

import pytest
import torch

from muser.core import SamplingParams
from muser.sampler import Sampler, apply_repeat_penalty, filter_logits
from muser.stopping import StopMatcher


def test_filters_keep_what_they_promise() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04]))
    ids, _ = filter_logits(logits, top_k=3, top_p=1.0, min_p=0.0)
    assert ids.tolist() == [0, 1, 2]
    ids, _ = filter_logits(logits, top_k=0, top_p=0.7, min_p=0.0)
    assert ids.tolist() == [0, 1]  # 0.5 < 0.7 <= 0.75
    ids, _ = filter_logits(logits, top_k=0, top_p=1.0, min_p=0.2)
    assert ids.tolist() == [0, 1, 2]  # 0.15 >= 0.2 * 0.5 > 0.06


def test_repeat_penalty_follows_llama_cpp() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repeat_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_greedy_and_seeded_sampling() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert Sampler(SamplingParams())(logits, []) == int(logits.argmax())
    params = SamplingParams(temperature=1.5, seed=7)
    assert len({Sampler(params)(logits, []) for _ in range(5)}) == 1
    sampler = Sampler(params)
    assert len({sampler(logits, []) for _ in range(50)}) > 5  # it really samples


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 2.0}, {"max_tokens": 0},
    {"top_k": -1}, {"repeat_penalty": 0.0}, {"stop": ("",)},
])
def test_bad_sampling_values_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_strings_hold_back_partial_matches() -> None:
    stops = StopMatcher(("END", "\n\n"))
    assert stops.push("hello E") == ("hello ", False)
    assert stops.push("N") == ("", False)
    assert stops.push("x") == ("ENx", False)
    assert stops.push(" wor\n") == (" wor", False)
    assert stops.push("\nmore") == ("", True)
    assert StopMatcher(("x",)).push("abc") == ("abc", False)
    tail = StopMatcher(("END",))
    assert tail.push("ok E") == ("ok ", False) and tail.flush() == "E"
