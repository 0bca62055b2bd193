"""The KV checksums a worker sends and the serving node verifies (muser/kvcache/snapshot.py):
their definition, computed by another route, and what they catch."""

from __future__ import annotations

import pytest
import torch

from muser.kvcache.snapshot import MOD, layer_checksums


def _by_definition(x: torch.Tensor) -> int:
    """s1 * 2^64 + s2 over x's signed 16-bit words w_j: s1 = sum w_j, s2 = sum w_j (j % MOD + 1),
    in Python integers."""
    w = x.contiguous().view(-1).view(torch.int16).tolist()
    return sum(w) * 2**64 + sum(v * (j % MOD + 1) for j, v in enumerate(w))


@pytest.mark.parametrize("shape, dtype", [
    ((3, 7), torch.bfloat16),  # shorter than a row of MOD words
    ((2, MOD), torch.bfloat16),  # exactly one row
    ((2, 2 * MOD + 5), torch.bfloat16),  # rows and a tail
    ((2, 3, MOD // 2 + 1), torch.float32),  # 4-byte values: two words each
    ((1, 0), torch.float32),  # an empty slice
])
def test_each_slice_by_its_definition(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype)
    assert layer_checksums(x) == [_by_definition(s) for s in x]


def test_no_slices_no_checksums() -> None:
    assert layer_checksums(torch.empty(0, 2, 4)) == []


def test_a_changed_or_moved_value_changes_its_slice_only() -> None:
    x = torch.randn(4, 2, 300, 64, generator=torch.Generator().manual_seed(0))
    want = layer_checksums(x)
    bumped = x.clone()
    bumped[2, 1, 17, 5] = torch.nextafter(bumped[2, 1, 17, 5], torch.tensor(1e9))  # one ulp
    got = layer_checksums(bumped)
    assert got[2] != want[2] and got[:2] == want[:2] and got[3:] == want[3:]
    swapped = x.clone()
    flat = swapped[1].view(-1)
    flat[[3, 4000]] = flat[[4000, 3]]
    assert layer_checksums(swapped)[1] != want[1]


def test_summed_in_passes_the_same(monkeypatch) -> None:
    """A GPU sums a long slice's words a few rows at a time: the passes add up to one."""
    from muser.kvcache import snapshot

    x = torch.randn(3, 5 * MOD + 17, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = layer_checksums(x)
    monkeypatch.setattr(snapshot, "SLAB", 3 * MOD * 2)  # two rows of MOD words a pass
    assert layer_checksums(x) == whole == [_by_definition(s) for s in x]
