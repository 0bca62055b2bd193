"""The tuning cache trusts a file only whole and only for its own fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muser.ops.tuning_cache import TuningCache

HERE = {"gpu": "NVIDIA H200", "driver": "580.159.04", "cuda": "13.0", "torch": "2.11.0",
        "triton": "3.6.0"}
ENTRY = {"config": "cublas", "timed_ms": {"cublas": 0.01}}


def test_saved_picks_load_back_and_merge(tmp_path: Path) -> None:
    cache = TuningCache.at(tmp_path, HERE)
    assert cache.path.parent == tmp_path / "tuning" and cache.path.name.startswith("nvidia-h200-")
    assert cache.load() == {}
    cache.save({"a": ENTRY})
    cache.save({"b": ENTRY})
    assert TuningCache.at(tmp_path, HERE).load() == {"a": ENTRY, "b": ENTRY}


def test_other_versions_get_their_own_file(tmp_path: Path) -> None:
    other = TuningCache.at(tmp_path, {**HERE, "triton": "3.7.0"})
    assert other.path != TuningCache.at(tmp_path, HERE).path


@pytest.mark.parametrize("text", ["{", "[]", '{"picks": {}}', "\xff", '{"fingerprint": 1}'])
def test_a_corrupt_file_is_ignored_with_a_warning(tmp_path: Path, text: str) -> None:
    cache = TuningCache.at(tmp_path, HERE)
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text(text)
    with pytest.warns(UserWarning, match="ignoring the tuning cache"):
        assert cache.load() == {}
    with pytest.warns(UserWarning):
        cache.save({"a": ENTRY})  # overwrites it
    assert cache.load() == {"a": ENTRY}


def test_a_foreign_file_is_ignored_with_a_warning(tmp_path: Path) -> None:
    cache = TuningCache.at(tmp_path, HERE)
    cache.path.parent.mkdir(parents=True)
    foreign = {**HERE, "gpu": "NVIDIA H100"}
    cache.path.write_text(json.dumps({"fingerprint": foreign, "picks": {"a": ENTRY}}))
    with pytest.warns(UserWarning, match="written for"):
        assert cache.load() == {}


def test_a_folder_of_its_own(tmp_path: Path) -> None:
    kernels = TuningCache.at(tmp_path, HERE, "kernels")
    assert kernels.path.parent == tmp_path / "kernels"
    assert kernels.path.name == TuningCache.at(tmp_path, HERE).path.name
