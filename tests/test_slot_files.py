"""Slot files on the embedded 270M (CPU): the KV a slot's last request left behind, saved to a
file and restored into the prefix cache of an engine that has forgotten it, is the same bits
(token ids, every sliding layer's retained ring rows and ring metadata, every full layer's
rows), and a prompt that continues it starts after it and gives the bits of a cold prefill.
Files of another model, foreign files and symlinks are refused."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from muser import LLM, SamplingParams
from muser.kvcache import slot_file
from muser.kvcache.snapshot import KVSnapshot, export
from muser.runner import Runner
from muser.slot_actions import SlotActions, SlotError
from tests.prefix_runs import run_and_decode

PAGE = 64


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(gguf_path, progress=False, device="cpu", max_num_seqs=2, max_model_len=1024,
               page_size=PAGE)


@pytest.fixture()
def slots(llm: LLM, tmp_path: Path) -> SlotActions:
    llm.runner.prefix.reset(llm.runner.pages)
    llm.engine.slot_ids.clear()
    return SlotActions(llm.engine, str(tmp_path), llm.fingerprint)


def _cached(runner: Runner, ids: list[int]) -> tuple[int, KVSnapshot | None]:
    """(rows of `ids` the prefix cache holds, their KV copied out when it holds them all)."""
    seq = runner.allocate(ids + [0], count=False)
    try:
        whole = seq.num_cached == len(ids)
        return seq.num_cached, export(runner, seq, torch.empty(0)) if whole else None
    finally:
        runner.free(seq)


@pytest.mark.parametrize("num_prompt", [
    601,  # ends inside a page, after the 512-row ring wrapped
    57,  # inside the first page, the ring not wrapped
])
def test_restored_kv_is_the_saved_bits_and_reused(llm: LLM, slots: SlotActions,
                                                  tmp_path: Path, num_prompt: int) -> None:
    runner = llm.runner
    prompt = llm.encode("The tide came in over the stones. " * 200)[:num_prompt]
    out = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    (slot, ids), = llm.engine.slot_ids.items()
    assert ids == prompt + out.token_ids[:-1]  # the last token was never fed back
    n, before = _cached(runner, ids)
    assert n == len(ids)

    saved = slots("save", slot, "turn.bin")
    assert saved["n_saved"] == len(ids) and saved["filename"] == "turn.bin"
    assert saved["n_written"] == (tmp_path / "turn.bin").stat().st_size
    assert slots("erase", slot) == {"id_slot": slot, "n_erased": len(ids)}
    assert _cached(runner, ids)[0] == 0 and slot not in llm.engine.slot_ids
    runner.prefix.reset(runner.pages)  # NOTE: nothing of the first turn is left in memory

    restored = slots("restore", 1 - slot, "turn.bin")
    assert restored["n_restored"] == len(ids) and restored["n_read"] == saved["n_written"]
    assert llm.engine.slot_ids[1 - slot] == ids
    n, after = _cached(runner, ids)
    assert n == len(ids) and after.ring == before.ring and after.num_tokens == len(ids)
    assert torch.equal(after.sliding, before.sliding) and torch.equal(after.full, before.full)

    follow = ids + llm.encode(" Then the lighthouse keeper wrote it down.")[1:]
    reused, hit, hit_tokens = run_and_decode(runner, follow, 8)
    assert reused == len(ids)
    runner.prefix.reset(runner.pages)
    cold_reused, cold, cold_tokens = run_and_decode(runner, follow, 8)
    assert cold_reused == 0
    assert torch.equal(hit, cold[reused:]) and hit_tokens == cold_tokens


def test_the_engine_serves_a_restored_prefix(llm: LLM, slots: SlotActions) -> None:
    """Through the engine: a request after a restore reports the restored rows as reused and
    generates what it generates cold (greedy, and seeded sampling)."""
    prompt = llm.encode("Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. " * 6)
    llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    (slot, ids), = llm.engine.slot_ids.items()
    slots("save", slot, "n.bin")
    follow = ids + llm.encode(" And then")[1:]
    runs = {}
    for restored in (True, False):
        llm.runner.prefix.reset(llm.runner.pages)
        if restored:
            slots("restore", 0, "n.bin")
        for params in (SamplingParams(max_tokens=6, ignore_eos=True),
                       SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)):
            req = llm.engine.add_request(follow, params)
            tokens = [o.token_id for o in llm.engine.run(req) if o.token_id is not None]
            runs[restored, params.temperature] = req.num_reused, tokens
            llm.runner.prefix.reset(llm.runner.pages)
            if restored:
                slots("restore", 0, "n.bin")
    for temp in (0.0, 0.9):
        assert runs[True, temp][0] == len(ids) and runs[False, temp][0] == 0
        assert runs[True, temp][1] == runs[False, temp][1]


def _rewrite_metadata(path: Path, key: str, value: str) -> None:
    """Change one metadata value of a safetensors file in place (same length: offsets kept)."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + size])
    old = header["__metadata__"][key]
    assert len(value) == len(old)
    header["__metadata__"][key] = value
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (size - len(new))
    data[8:8 + size] = new
    path.write_bytes(bytes(data))


def test_foreign_files_and_symlinks_are_refused(llm: LLM, slots: SlotActions,
                                                tmp_path: Path) -> None:
    prompt = llm.encode("A short prompt about the sea.")
    llm.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    (slot, _), = llm.engine.slot_ids.items()
    slots("save", slot, "mine.bin")
    other = tmp_path / "other.bin"
    other.write_bytes((tmp_path / "mine.bin").read_bytes())
    _rewrite_metadata(other, "fingerprint", "0" * len(slots._fingerprint()))
    (tmp_path / "junk.bin").write_bytes(b"not a slot file at all")
    os.symlink(tmp_path / "mine.bin", tmp_path / "link.bin")
    cases = {"other.bin": (400, "another model"), "junk.bin": (400, "not a safetensors"),
             "link.bin": (400, "symlink"), "missing.bin": (404, "no slot file"),
             "../mine.bin": (400, "Invalid filename"), "/etc/passwd": (400, "Invalid filename")}
    for name, (status, words) in cases.items():
        with pytest.raises(SlotError) as err:
            slots("restore", 0, name)
        assert err.value.status == status and words in str(err.value), (name, err.value)
    with pytest.raises(SlotError) as err:
        slots("save", 1 - slot, "empty.bin")
    assert err.value.status == 400 and "holds no KV" in str(err.value)
    no_folder = SlotActions(llm.engine, None, slots._fingerprint)
    with pytest.raises(SlotError) as err:
        no_folder("save", slot, "x.bin")
    assert err.value.status == 501 and "--slot-save-path" in str(err.value)
    ids, snap, _ = slot_file.read(str(tmp_path / "mine.bin"), slots._fingerprint(),
                                  llm.runner.pool.dtype, (
                                      len(llm.model_config.layers_of("sliding")),
                                      len(llm.model_config.layers_of("global")),
                                      llm.model_config.num_kv_heads,
                                      llm.model_config.head_dim))
    assert snap.num_tokens == len(ids)
