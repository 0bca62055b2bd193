"""Stored projection picks: keys and configs round-trip through JSON; an entry that is not a
valid pick of the right kind for its key is ignored with a warning, never trusted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from muser.ops.triton import picks
from muser.ops.triton.gemm import GemmConfig
from muser.ops.triton.gemv import GemvConfig

GEMV = GemvConfig("dot", 64, 256, 4, 4, 4, False)
GEMM = GemmConfig(64, 128, 64, 4, 3)


@pytest.mark.parametrize("key, pick", [
    ((4, 1536, 1152, "norm", torch.bfloat16, torch.float32), GEMV),
    ((512, 13824, 1152, "geglu", torch.bfloat16, torch.bfloat16), GEMM),
    ((1, 262144, 1152, "", torch.bfloat16, torch.bfloat16), None),
])
def test_round_trip(key: tuple, pick) -> None:
    text = picks.key_text(key)
    entry = {"config": picks.config_json(pick), "timed_ms": {"x": 1.0}}
    assert picks.parse_entries({text: entry}, Path("t")) == {key: (pick, {"x": 1.0})}


@pytest.mark.parametrize("text, config", [
    ("4|1536|1152|norm|bfloat16|float32", picks.config_json(GEMM)),  # GEMM for decode rows
    ("64|1536|1152||bfloat16|float32", picks.config_json(GEMV)),  # GEMV for a chunk
    ("4|1536|1152|norm|bfloat16|float32", {"gemv": {"kind": "mma", "block_m": 8,
                                                    "block_k": 64, "split_k": 1,
                                                    "num_warps": 4}}),
    ("4|1536|1152|norm|bfloat16|float32", {"gemv": {"kind": "fma", "block_m": 0,
                                                    "block_k": 64, "split_k": 1,
                                                    "num_warps": 4}}),
    ("4|1536|1152|norm|bfloat16|float32", {"gemv": {"bogus": 1}}),
    ("4|1536|1152|swish|bfloat16|float32", "cublas"),
    ("4|1536|1152|norm|int8|float32", "cublas"),
    ("4|1536", "cublas"),
    ("4|1536|1152|norm|bfloat16|float32", 7),
])
def test_bad_entries_are_ignored_with_a_warning(text: str, config) -> None:
    good = picks.key_text((1, 8, 8, "", torch.float32, torch.float32))
    entries = {text: {"config": config}, good: {"config": "cublas"}}
    with pytest.warns(UserWarning, match="ignoring 1 bad entries"):
        parsed = picks.parse_entries(entries, Path("t"))
    assert list(parsed) == [(1, 8, 8, "", torch.float32, torch.float32)]
