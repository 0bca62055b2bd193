"""bench/kv_fp8_check.py's arithmetic (the GPU run itself is the lead's): agreement of a
teacher-forced run with the bfloat16 one, and the fp8 / bfloat16 ratios of a preset's cells."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

# NOTE: bench/ holds scripts, not a package
_SPEC = importlib.util.spec_from_file_location(
    "kv_fp8_check", Path(__file__).resolve().parents[1] / "bench" / "kv_fp8_check.py")
check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(check)


def test_agreement_counts_steps_and_finds_the_first_difference() -> None:
    ref = torch.zeros(4, 5)
    ref[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1.0
    other = ref.clone()
    other[2, 0] = 1.5  # step 2 picks token 0
    got = check.agreement([1, 2, 3, 4], ref, other)
    assert (got["greedy_agree"], got["steps"], got["first_disagreement"]) == (3, 4, 2)
    assert got["max_abs_dlogit"] == 1.5
    assert check.agreement([1, 2, 3, 4], ref, ref)["first_disagreement"] is None


def test_ratios_pair_depths() -> None:
    cells = [{"kv_dtype": "bfloat16", "tokens_at_budget": 100,
              "depths": [{"depth": 32768, "tpot_ms": 10.0}, {"depth": 131000, "tpot_ms": 20.0}]},
             {"kv_dtype": "fp8", "tokens_at_budget": 194,
              "depths": [{"depth": 32768, "tpot_ms": 9.0}, {"depth": 131000, "tpot_ms": 15.0}]}]
    assert check.ratios(cells[:1]) == {}
    assert check.ratios(cells) == {"tokens_fp8_over_bf16": 1.94,
                                   "tpot_fp8_over_bf16": {"32768": 0.9, "131000": 0.75}}
    assert check.seeded_ids(5, 300, 1) == check.seeded_ids(5, 300, 1)
