"""Stored kernel picks of every family (dense, FP8, GGUF blocks): keys and configs round-trip
through JSON; an entry that is not a valid pick of the right kind for its key and family is
ignored with a warning, never trusted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from muser.ops.triton import picks
from muser.ops.triton.gemm import GemmConfig
from muser.ops.triton.gemv import GemvConfig
from muser.ops.triton.gemv_blocks import BlockGemvConfig

GEMV = GemvConfig("dot", 64, 256, 4, 4, 4, False)
GEMM = GemmConfig(64, 128, 64, 4, 3)
DOT8 = GemvConfig("dot8", 64, 512, 1, 4, 4)
ROW = GemvConfig("row", 8, 1024, 1, 4)
BLOCK = BlockGemvConfig(32, 4, 2, 4)


@pytest.mark.parametrize("family, key, pick", [
    ("linear", (4, 1536, 1152, "norm", torch.bfloat16, torch.float32), GEMV),
    ("linear", (512, 13824, 1152, "geglu", torch.bfloat16, torch.bfloat16), GEMM),
    ("linear", (1, 262144, 1152, "", torch.bfloat16, torch.bfloat16), None),
    # the exact route's FP8 codes, keyed by their dtype beside bf16 weights' picks
    ("linear", (5, 1536, 1152, "exact", torch.float8_e4m3fn, torch.bfloat16), GEMV),
    ("linear", (512, 13824, 1152, "exact+geglu", torch.float8_e4m3fn, torch.bfloat16), GEMM),
    ("fp8", (1, 1536, 1152, "norm", torch.bfloat16, torch.bfloat16), DOT8),
    ("fp8", (1, 1536, 1152, "", torch.bfloat16, torch.bfloat16), "scaled_mm"),
    ("fp8", (1, 1536, 1152, "geglu", torch.bfloat16, torch.bfloat16), ROW),
    ("fp8", (512, 13824, 1152, "geglu", torch.float32, torch.float32), "dequant"),
    ("fp8", (512, 1536, 200, "", torch.bfloat16, torch.bfloat16), "dequant"),  # K % 16 != 0
    ("blocks", (2, 6912, 1152, QT.Q4_K, torch.bfloat16), BLOCK),
    ("blocks_exact", (48, 6912, 1152, QT.Q6_K, torch.float32, torch.bfloat16, 256), GEMV),
])
def test_round_trip(family: str, key: tuple, pick) -> None:
    stored = picks.entries({family: {key: (pick, {"x": 1.0})}})
    parsed = picks.parse_entries(stored, Path("t"))
    assert parsed == {f: ({key: (pick, {"x": 1.0})} if f == family else {})
                      for f in picks.FAMILIES}


def test_families_do_not_share_keys() -> None:
    """The same shape as a dense and as an FP8 projection: two entries, each read back into its
    own family."""
    key = (1, 1536, 1152, "", torch.bfloat16, torch.bfloat16)
    stored = picks.entries({"linear": {key: (GEMV, {})}, "fp8": {key: (DOT8, {})}})
    assert len(stored) == 2
    parsed = picks.parse_entries(stored, Path("t"))
    assert parsed["linear"] == {key: (GEMV, {})} and parsed["fp8"] == {key: (DOT8, {})}


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
    ("4|1536|1152|norm|bfloat16|float32", picks.config_json(DOT8)),  # an FP8 GEMV kind
    ("4|1536|1152|norm|bfloat16|float32", "scaled_mm"),  # an FP8 route
    ("fp8|4|1536|1152|norm|bfloat16|float32", "cublas"),
    ("fp8|4|1536|1152|norm|bfloat16|float32", "dequant"),  # decode rows: a GEMV or scaled_mm
    ("fp8|512|1536|1152||bfloat16|bfloat16", "dequant"),  # bfloat16 chunks: scaled_mm only
    ("fp8|512|1536|200||bfloat16|bfloat16", "scaled_mm"),  # K % 16 != 0: cuBLAS refuses
    ("fp8|64|1536|1152||bfloat16|bfloat16", picks.config_json(DOT8)),  # GEMV for a chunk
    ("fp8|2|1536|1152||bfloat16|bfloat16", picks.config_json(ROW)),  # the row loop: 1 row
    ("1|1536|1152||bfloat16|bfloat16", picks.config_json(ROW)),  # an FP8 GEMV kind
    ("blocks|1|6912|1152|Q9_Z|bfloat16", picks.config_json(BLOCK)),  # no such block type
    ("blocks|1|6912|1152|Q4_K|bfloat16", picks.config_json(GEMV)),
    ("blocks|1|6912|1152|Q4_K|bfloat16", {"block_gemv": {"block_m": 0, "blocks": 4,
                                                         "split_k": 1, "num_warps": 4}}),
    ("blocks|64|6912|1152|Q4_K|bfloat16", picks.config_json(BLOCK)),  # no block GEMV for 64
    ("blocks_exact|8|6912|1152|Q4_K|bfloat16|bfloat16|256", picks.config_json(BLOCK)),
    ("blocks_exact|8|6912|1152|Q4_K|bfloat16|bfloat16|256", picks.config_json(
        GemvConfig("fma", 8, 256, 1, 4))),  # the exact route runs the dot kind only
    ("blocks_exact|80|6912|1152|Q4_K|bfloat16|bfloat16|256", picks.config_json(GEMV)),
])
def test_bad_entries_are_ignored_with_a_warning(text: str, config) -> None:
    good = picks.key_text((1, 8, 8, "", torch.float32, torch.float32))
    entries = {text: {"config": config}, good: {"config": "cublas"}}
    with pytest.warns(UserWarning, match="ignoring 1 bad entries"):
        parsed = picks.parse_entries(entries, Path("t"))
    assert parsed == {"linear": {(1, 8, 8, "", torch.float32, torch.float32): (None, {})},
                      "fp8": {}, "blocks": {}, "blocks_exact": {}}
