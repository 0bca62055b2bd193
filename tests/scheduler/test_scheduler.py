"""Decode-first policy on host integers; a fake runner commits rows and emits fixed tokens."""

from __future__ import annotations

import itertools

import pytest

from muser.core import Request, SamplingParams, Status
from muser.scheduler import Batch, QueueFull, Scheduler


def _req(num_prompt: int, max_tokens: int = 4) -> Request:
    return Request(list(range(num_prompt)), SamplingParams(max_tokens=max_tokens))


def _commit(sched: Scheduler, batch: Batch) -> None:
    """What the engine does after a forward pass: count rows, emit a token, finish at max_tokens."""
    for req, n in zip(batch.reqs, batch.num_tokens):
        req.num_cached += n
        if req.num_prefill_left == 0:
            req.status = Status.DECODE
            req.output_ids.append(req.uid % 100)
            if len(req.output_ids) >= req.sampling.max_tokens:
                sched.finish(req)


def _drain(sched: Scheduler) -> list[Batch]:
    batches = []
    while (batch := sched.schedule()) is not None:
        batches.append(batch)
        _commit(sched, batch)
    return batches


def test_idle_scheduler_returns_nothing() -> None:
    assert Scheduler(4).schedule() is None


def test_long_prompt_alone_uses_full_chunks() -> None:
    sched = Scheduler(4)
    sched.add(_req(1200, max_tokens=1))
    widths = [b.num_tokens[0] for b in _drain(sched)]
    assert widths == [512, 512, 176]


def test_chunks_shrink_while_a_decode_waits_and_decode_goes_first() -> None:
    sched = Scheduler(4)
    short = _req(3, max_tokens=50)
    sched.add(short)
    _commit(sched, sched.schedule())
    assert short.status == Status.DECODE
    sched.add(_req(2000, max_tokens=1))
    batches = [sched.schedule() for _ in range(6)]
    for b in batches:
        _commit(sched, b)
    assert [b.work_class for b in batches] == ["decode", "prefill"] * 3
    assert [b.num_tokens[0] for b in batches if b.is_prefill] == [64, 64, 64]


def test_fixed_policy_keeps_512_chunks() -> None:
    sched = Scheduler(4, adaptive=False)
    sched.add(_req(3, max_tokens=50))
    _commit(sched, sched.schedule())
    sched.add(_req(2000, max_tokens=1))
    widths = [b.num_tokens[0] for b in _drain(sched) if b.is_prefill]
    assert widths == [512, 512, 512, 464]


def test_every_ready_row_decodes_in_one_pass() -> None:
    sched = Scheduler(8)
    reqs = [_req(n, max_tokens=3) for n in (5, 70, 600, 9)]
    for r in reqs:
        sched.add(r)
    num_decodes = 0
    while (batch := sched.schedule()) is not None:
        if not batch.is_prefill:
            num_decodes += 1
            assert batch.reqs == sched.decode_ready and batch.num_tokens == [1] * len(batch.reqs)
        _commit(sched, batch)
    assert num_decodes < sum(r.sampling.max_tokens for r in reqs)
    assert all(r.status == Status.FINISHED and len(r.output_ids) == 3 for r in reqs)


def test_no_two_prefill_chunks_in_a_row_while_decodes_wait() -> None:
    sched = Scheduler(8)
    for n in (3, 900, 4, 1500, 2):
        sched.add(_req(n, max_tokens=20))
    batches = []
    while (batch := sched.schedule()) is not None:
        had_decode = bool(sched.decode_ready)
        batches.append((batch, had_decode))
        _commit(sched, batch)
    for (prev, _), (cur, decodes_waiting) in itertools.pairwise(batches):
        if prev.is_prefill and cur.is_prefill:
            assert not decodes_waiting
    assert sched.stats.steps["decode"] + sched.stats.steps["prefill"] == len(batches)
    assert sched.stats.rows["prefill"] == 3 + 900 + 4 + 1500 + 2


def test_admission_is_bounded_by_max_num_seqs() -> None:
    sched = Scheduler(2)
    for _ in range(5):
        sched.add(_req(4))
    sched.schedule()
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    assert sched.queue_depth() == {"decode": 0, "prefill": 5}


def test_waiting_queue_is_bounded() -> None:
    sched = Scheduler(1, max_waiting=2)
    sched.add(_req(4))
    sched.add(_req(4))
    with pytest.raises(QueueFull):
        sched.add(_req(4))
    sched.schedule()
    sched.add(_req(4))


def test_remove_frees_a_running_slot_for_the_next_request() -> None:
    sched = Scheduler(1)
    first, second = _req(4), _req(4)
    sched.add(first)
    sched.add(second)
    sched.schedule()
    assert sched.remove(first.uid) is first
    assert sched.remove(first.uid) is None
    batch = sched.schedule()
    assert batch.reqs == [second]
