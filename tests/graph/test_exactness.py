"""DESIGN section 7 on the CPU, bitwise: a prompt three windows long gives the same logits and
K/V rows prefilled in one chunk, in chunks of several widths (some that do not divide the
window), token by token, and inside steps shared with 7 other sequences of other lengths and
ring states. Equality holds by construction (muser.ops.cpu: one reduction order per output
element whatever the width), so it is asserted with torch.equal, on any CPU."""

from __future__ import annotations

import pytest
import torch

from muser import LLM
from tests.graph.exactness import capture, capture_in_batch, capture_one_chunk, first_difference

W = 512  # Gemma 3 270M sliding window
WIDTHS = [64, 37, 100, 512, 1]  # 512: the default --prefill-chunk; 1: token by token
POSITIONS = {1, 31, 32, 33, W - 1, W, W + 1, 2 * W - 1, 2 * W, 2 * W + 1, 3 * W - 1}


def _chunk_edges(width: int) -> set[int]:
    """The last row of a chunk and the first of the next: the first two boundaries, and the
    two around each window multiple."""
    ends = {width, 2 * width}
    for m in (W, 2 * W):
        ends |= {m // width * width, m // width * width + width}
    return {e + d for e in ends for d in (-1, 0) if 0 < e + d < 3 * W}


POSITIONS |= {p for w in WIDTHS[:4] for p in _chunk_edges(w)}


def _prompt(length: int) -> list[int]:
    """BOS, then seeded ordinary-token ids."""
    gen = torch.Generator().manual_seed(7)
    return [2] + torch.randint(1000, 200_000, (length - 1,), generator=gen).tolist()


@pytest.fixture(scope="module", params=["float32", "float16"])
def runs(request, gguf_path) -> tuple[str, dict]:
    dtype = request.param
    llm = LLM(gguf_path, progress=False, device="cpu", dtype=dtype, kv_dtype="float32",
              max_num_seqs=8, max_model_len=2048)
    ids = _prompt(3 * W)
    results = {"one": capture_one_chunk(llm.runner, ids, POSITIONS)}
    for width in WIDTHS:
        results[f"c{width}"] = capture(llm.runner, ids, width, POSITIONS)
    others = [_prompt(n)[::-1] for n in (3, 40, 300, 600, 900, 1030, 1100)]
    results["batch"] = capture_in_batch(llm.runner, ids, 64, POSITIONS, others,
                                        [1, 1, 5, 1, 17, 1, 64])
    return dtype, results


@pytest.mark.parametrize("name", [f"c{w}" for w in WIDTHS] + ["batch"])
def test_every_chunking_is_bitwise_the_one_chunk_prefill(runs, name: str) -> None:
    dtype, results = runs
    one, other = results["one"], results[name]
    assert first_difference(one[0], other[0]) is None, f"{dtype} logits"
    assert first_difference(one[1], other[1]) is None, f"{dtype} K/V rows"
