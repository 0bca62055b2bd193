"""Disaggregated prefill on the CPU, two processes on loopback: a real `muser prefill-worker`
and an engine in this process. Remote prefill is bitwise local prefill; every fault ends in a
local prefill with the same tokens, a warning and its outcome counted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from muser import LLM, SamplingParams
from muser.disagg.client import attach
from muser.disagg.worker import prefill
from tests.server.conftest import _free_port

PROMPT = [(13 * j) % 5000 + 10 for j in range(560)]  # past the 512-row ring: it wraps
SHORT = PROMPT[:48]
GREEDY = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(gguf_path, device="cpu", max_model_len=2048, progress=False)


@pytest.fixture(scope="module")
def local_tokens(llm: LLM) -> list[int]:
    return llm.generate(SHORT, GREEDY).token_ids


def _served(llm: LLM, address: str, timeout_s: float = 60.0, min_tokens: int = 16):
    llm.engine.runner.prefix.forget(SHORT)  # NOTE: else SHORT, served before, is all cached
    remote = attach(llm, [address], min_tokens, timeout_s)
    try:
        tokens = llm.generate(SHORT, GREEDY).token_ids
    finally:
        llm.engine.remove_source(remote)
    return tokens, remote.stats()["outcomes"]


def test_remote_prefill_is_bitwise_the_local_one(llm: LLM, gguf_path: Path,
                                                 worker_factory) -> None:
    worker = worker_factory(["--model", str(gguf_path)])
    remote = attach(llm, [worker.address], 100, 60.0)
    try:
        far = remote._workers[0].transfer(7, PROMPT)
        assert far.outcome == "remote", far.reason
        served = llm.generate(PROMPT, GREEDY)  # NOTE: first, while no prefix of it is cached here
        assert remote.stats()["outcomes"]["remote"] == 1
        assert remote.stats()["bytes"]["count"] == 1
        near = prefill(llm, PROMPT)
        assert far.snapshot.ring == near.ring and near.ring.logical_origin > 0
        for name in ("sliding", "full", "logits"):
            assert torch.equal(getattr(far.snapshot, name), getattr(near, name)), name
    finally:
        llm.engine.remove_source(remote)
    assert served.token_ids == llm.generate(PROMPT, GREEDY).token_ids


def test_a_short_prompt_stays_local(llm: LLM, gguf_path: Path, worker_factory,
                                    local_tokens: list[int]) -> None:
    worker = worker_factory(["--model", str(gguf_path)])
    tokens, outcomes = _served(llm, worker.address, min_tokens=len(SHORT) + 1)
    assert tokens == local_tokens and outcomes["local_short"] == 1 and outcomes["remote"] == 0


def test_a_prompt_mostly_cached_here_stays_local(llm: LLM, gguf_path: Path,
                                                 worker_factory) -> None:
    """The decision counts the tokens a local prefill would compute: a chat's next turn whose
    earlier turns are in the prefix cache is prefilled here, a fresh prompt as long goes out."""
    first = llm.generate(PROMPT, GREEDY).token_ids
    turn = PROMPT + first + [(7 * j) % 5000 + 10 for j in range(40)]
    fresh = [(11 * j) % 5000 + 10 for j in range(len(turn))]
    worker = worker_factory(["--model", str(gguf_path)])
    remote = attach(llm, [worker.address], 100, 60.0)
    try:
        assert llm.engine.runner.prefix.cached_tokens(turn) >= len(PROMPT)
        served = llm.generate(turn, GREEDY).token_ids
        assert remote.stats()["outcomes"]["local_short"] == 1
        assert remote.stats()["outcomes"]["remote"] == 0
        llm.generate(fresh, GREEDY)
        assert remote.stats()["outcomes"]["remote"] == 1
    finally:
        llm.engine.remove_source(remote)
    assert served == llm.generate(turn, GREEDY).token_ids


def test_no_worker_running(llm: LLM, local_tokens: list[int], caplog) -> None:
    with caplog.at_level(logging.WARNING, "muser.disagg"):
        tokens, outcomes = _served(llm, f"127.0.0.1:{_free_port()}")
    assert tokens == local_tokens and outcomes["fallback_down"] == 1
    assert "no prefill worker listens" in caplog.text


def test_a_worker_of_another_model(llm: LLM, worker_factory, local_tokens: list[int],
                                   caplog) -> None:
    worker = worker_factory(["--load-format", "dummy", "--model-config", "gemma3-270m"])
    with caplog.at_level(logging.WARNING, "muser.disagg"):
        tokens, outcomes = _served(llm, worker.address)
    assert tokens == local_tokens and outcomes["fallback_fingerprint"] == 1
    assert "fallback_fingerprint" in caplog.text


CORRUPT = """
import muser.disagg.worker as w
_response = w.response
def response(*args):
    header, tensors = _response(*args)
    tensors[1].view(-1)[0] += 1.0  # after the checksums were taken
    return header, tensors
w.response = response
"""
SLOW = """
import time, muser.disagg.worker as w
_prefill = w.prefill
w.prefill = lambda *args: (time.sleep(8), _prefill(*args))[1]
"""
DIES = """
import os, muser.disagg.wire as wire
_send = wire.Link.send
def send(self, header, tensors=()):
    if tensors:  # the KV: half of it, then gone
        _send(self, header, tensors[:1])
        os._exit(1)
    return _send(self, header, tensors)
wire.Link.send = send
"""


@pytest.mark.parametrize(("patch", "outcome", "timeout_s"), [
    (CORRUPT, "fallback_checksum", 60.0), (SLOW, "fallback_timeout", 3.0),
    (DIES, "fallback_down", 60.0)], ids=["corrupt", "slow", "killed-mid-transfer"])
def test_a_faulty_worker(llm: LLM, gguf_path: Path, worker_factory, local_tokens: list[int],
                         caplog, patch: str, outcome: str, timeout_s: float) -> None:
    worker = worker_factory(["--model", str(gguf_path)], patch)
    with caplog.at_level(logging.WARNING, "muser.disagg"):
        tokens, outcomes = _served(llm, worker.address, timeout_s)
    assert tokens == local_tokens and outcomes[outcome] == 1, outcomes
    assert outcome in caplog.text


def test_a_worker_restarted_between_requests(llm: LLM, gguf_path: Path, worker_factory,
                                             local_tokens: list[int], caplog) -> None:
    port = _free_port()
    first = worker_factory(["--model", str(gguf_path)], port=port)
    remote = attach(llm, [first.address], 16, 60.0)
    try:
        def served() -> list[int]:
            llm.engine.runner.prefix.forget(SHORT)  # NOTE: else the last run's KV serves it
            return llm.generate(SHORT, GREEDY).token_ids

        with caplog.at_level(logging.WARNING, "muser.disagg"):
            runs = [served()]
            first.stop()
            # NOTE: a worker takes seconds to load: the idle link's heartbeat check (every
            # second) sees the old one gone first, so the next request opens a new link
            worker_factory(["--model", str(gguf_path)], port=port)
            runs += [served() for _ in range(2)]
    finally:
        llm.engine.remove_source(remote)
    assert runs == [local_tokens] * 3
    assert f"prefill worker 127.0.0.1:{port} is down" in caplog.text
    assert remote.stats()["outcomes"]["remote"] == 3


def test_auto_crossover_is_measured_and_logged(llm: LLM, gguf_path: Path, worker_factory,
                                               caplog) -> None:
    worker = worker_factory(["--model", str(gguf_path)])
    with caplog.at_level(logging.INFO, "muser.disagg"):
        remote = attach(llm, [worker.address], None, 60.0)
    llm.engine.remove_source(remote)
    measured = [line for line in caplog.text.splitlines() if "crossover:" in line]
    assert [int(line.split("crossover: ")[1].split()[0]) for line in measured][:1] == [128]
    assert all("local prefill" in line and "remote round trip" in line for line in measured)
    lengths = [int(line.split("crossover: ")[1].split()[0]) for line in measured]
    assert remote.min_tokens in (lengths[-1], 1 << 62)  # the first length remote won, or none
    assert remote.stats()["outcomes"]["remote"] == 0  # measuring is not serving


def test_the_nccl_transport_needs_two_gpus() -> None:
    from muser.disagg.wire import check_backend
    from muser.errors import MuserError

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible >= 2:
        pytest.skip("two GPUs are visible: the NCCL transport is allowed here")
    with pytest.raises(MuserError, match=f"between two GPUs; {visible} visible"):
        check_backend("nccl", torch.device("cuda" if visible else "cpu"))
