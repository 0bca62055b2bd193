"""The scheduler on host integers: a fake engine commits rows, emits tokens and counts pages."""

from __future__ import annotations

import random

import pytest

from muser.core import SamplingParams, Status
from muser.scheduler import Batch, QueueFull, Scheduler
from muser.sequence import Sequence


def _req(num_prompt: int, max_tokens: int = 4) -> Sequence:
    return Sequence(list(range(num_prompt)), SamplingParams(max_tokens=max_tokens))


class _Engine:
    """What the engine does around the scheduler: pages held per sequence (ceil(rows / page
    size)), rows committed after each step, a token when a sequence's rows are all computed,
    finish at max_tokens."""

    def __init__(self, sched: Scheduler, num_pages: int | None = None) -> None:
        self.sched, self.num_pages = sched, num_pages
        self.batches: list[Batch] = []

    def free_pages(self) -> int | None:
        if self.num_pages is None:
            return None
        ps = self.sched.page_size
        return self.num_pages - sum(-(-r.num_cached // ps) for r in self.sched.running)

    def step(self) -> Batch | None:
        batch = self.sched.schedule(self.free_pages())
        if batch is None:
            return None
        for req in batch.preempted:
            assert req.num_cached == 0 and req.status == Status.WAITING
        for req, n in zip(batch.reqs, batch.num_tokens):
            assert 1 <= n <= req.num_pending
            req.num_cached += n
            if req.num_pending == 0:
                req.status = Status.DECODE
                req.output_ids.append(req.uid % 100)
                if len(req.output_ids) >= req.sampling.max_tokens:
                    self.sched.finish(req)
        if self.num_pages is not None:
            assert self.free_pages() >= 0, "more KV pages in use than the pool holds"
        self.batches.append(batch)
        return batch

    def drain(self, limit: int = 100_000) -> list[Batch]:
        start = len(self.batches)
        while self.step() is not None:
            assert len(self.batches) < limit
        return self.batches[start:]


def test_idle_scheduler_returns_nothing() -> None:
    assert Scheduler(4).schedule() is None


def test_a_long_prompt_alone_uses_full_chunks() -> None:
    sched = Scheduler(4)
    sched.add(_req(1200, max_tokens=1))
    assert [b.num_tokens for b in _Engine(sched).drain()] == [[512], [512], [176]]


def test_several_prompts_share_a_step_up_to_the_budget() -> None:
    sched = Scheduler(8, prefill_chunk=512, max_batched_tokens=1024)
    for n in (300, 300, 300, 700):
        sched.add(_req(n, max_tokens=1))
    first = sched.schedule()
    assert first.kind == "prefill" and first.num_tokens == [300, 300, 300, 124]


def test_decode_rows_go_first_and_prefill_rows_are_capped_while_they_run() -> None:
    sched = Scheduler(4, decode_waiting_chunk=64, max_batched_tokens=1024)
    engine = _Engine(sched)
    short = _req(3, max_tokens=50)
    sched.add(short)
    engine.step()
    assert short.status == Status.DECODE
    long = _req(2000, max_tokens=1)
    sched.add(long)
    steps = [engine.step() for _ in range(3)]
    for b in steps:
        assert b.kind == "mixed" and b.reqs[0] is short and b.num_decode == 1
        assert b.num_tokens == [1, 64]


def test_the_fixed_policy_prefills_full_chunks_beside_decodes() -> None:
    sched = Scheduler(4, adaptive=False, max_batched_tokens=1024)
    engine = _Engine(sched)
    sched.add(_req(3, max_tokens=50))
    engine.step()
    sched.add(_req(2000, max_tokens=1))
    widths = [b.num_prefill_rows for b in engine.drain() if b.num_prefill_rows]
    assert widths == [512, 512, 512, 464]


def test_every_ready_row_decodes_in_every_step() -> None:
    sched = Scheduler(8, decode_waiting_chunk=32)
    engine = _Engine(sched)
    reqs = [_req(n, max_tokens=3) for n in (5, 70, 600, 9)]
    for r in reqs:
        sched.add(r)
    while True:
        ready = sched.decode_ready
        batch = engine.step()
        if batch is None:
            break
        assert batch.reqs[:batch.num_decode] == ready
    assert all(r.status == Status.FINISHED and len(r.output_ids) == 3 for r in reqs)


@pytest.mark.parametrize("seed", range(20))
def test_random_traffic_keeps_every_invariant(seed: int) -> None:
    """Random arrivals and lengths, with and without a small page pool: the budget is never
    exceeded, no decode-ready row is skipped, the cap holds while rows decode, pages are never
    overdrawn, nothing finished is scheduled again, and every request completes."""
    rng = random.Random(seed)
    num_pages = rng.choice([None, 24, 60])
    page_size = 16
    sched = Scheduler(rng.choice([2, 4, 8]), prefill_chunk=rng.choice([32, 64]),
                      decode_waiting_chunk=rng.choice([8, 16]), max_batched_tokens=96,
                      page_size=page_size)
    engine = _Engine(sched, num_pages)
    longest = (num_pages or 10**6) * page_size // 2  # any one sequence fits the pool
    pending = [_req(rng.randint(1, min(300, longest - 40)), rng.randint(1, 40))
               for _ in range(30)]
    reqs, finished = list(pending), set()
    while pending or sched.has_work:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                sched.add(pending.pop())
        ready = list(sched.decode_ready)
        batch = engine.step()
        if batch is None:
            assert not sched.running and not sched.waiting
            continue
        kept = [r for r in ready if r not in batch.preempted]
        assert batch.reqs[:batch.num_decode] == kept
        assert sum(batch.num_tokens) <= sched.max_batched_tokens
        if batch.num_decode:
            assert batch.num_prefill_rows <= sched.decode_waiting_chunk
        assert not finished & {r.uid for r in batch.reqs}
        finished |= {r.uid for r in batch.reqs if r.status == Status.FINISHED}
        assert len(engine.batches) < 20_000
    assert all(r.status == Status.FINISHED and len(r.output_ids) == r.sampling.max_tokens
               for r in reqs)


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones() -> None:
    sched = Scheduler(8, prefill_chunk=64, decode_waiting_chunk=16, max_batched_tokens=64)
    engine = _Engine(sched)
    long = _req(1000, max_tokens=1)
    sched.add(_req(4, max_tokens=10_000))  # decodes throughout
    engine.step()
    sched.add(long)
    steps = 0
    while long.status != Status.FINISHED:
        if len(sched.running) < 8:
            sched.add(_req(20, max_tokens=2))
        engine.step()
        steps += 1
        assert steps <= 1000 // 16 + 1  # the oldest prompt takes the prefill rows first


def test_a_cancelled_request_is_never_scheduled_again() -> None:
    sched = Scheduler(4)
    engine = _Engine(sched)
    keep, drop = _req(10, max_tokens=5), _req(700, max_tokens=5)
    sched.add(keep)
    sched.add(drop)
    engine.step()
    assert sched.remove(drop.uid) is drop
    for b in engine.drain():
        assert drop not in b.reqs


def test_requests_wait_for_pages_instead_of_failing() -> None:
    """A pool of 8 pages of 16 rows: two 60-row prompts fit (4 pages each), the third waits
    until one finishes."""
    sched = Scheduler(4, prefill_chunk=64, max_batched_tokens=256, page_size=16)
    engine = _Engine(sched, num_pages=8)
    reqs = [_req(60, max_tokens=2) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    first = engine.step()
    assert first.reqs == reqs[:2] and first.num_tokens == [60, 60]
    engine.drain()
    assert all(r.status == Status.FINISHED for r in reqs)


def test_decode_preempts_the_newest_sequence_when_pages_run_out() -> None:
    sched = Scheduler(4, prefill_chunk=64, max_batched_tokens=256, page_size=16)
    engine = _Engine(sched, num_pages=4)
    old, new = _req(31, max_tokens=30), _req(31, max_tokens=30)  # 61 rows: 4 pages
    sched.add(old)
    sched.add(new)
    engine.step()  # 2 pages each, the pool is full
    engine.step()  # both decode row 32 (inside their second page)
    batch = engine.step()  # row 33 needs a third page each: the newest gives its pages back
    assert batch.preempted == [new] and batch.reqs == [old]
    assert sched.stats.preemptions == 1 and sched.waiting[0] is new
    engine.drain()
    assert len(old.output_ids) == len(new.output_ids) == 30


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


def test_the_budget_must_hold_every_decode_row() -> None:
    with pytest.raises(ValueError, match="max_batched_tokens"):
        Scheduler(8, max_batched_tokens=4)


def test_a_preemption_counts_the_pages_the_hook_says_it_gave_back() -> None:
    """With shared prefix pages a preempted sequence may give back fewer pages than it fills:
    the scheduler counts what the engine's preempt hook returns, and preempts again if needed."""
    def run(hook) -> Batch:
        sched = Scheduler(4, prefill_chunk=64, max_batched_tokens=256, page_size=16)
        engine = _Engine(sched, num_pages=6)
        reqs = [_req(31, max_tokens=30) for _ in range(3)]  # 2 pages each: the pool is full
        for req in reqs:
            sched.add(req)
        engine.step()
        engine.step()  # every sequence decodes row 32, inside its second page
        return sched.schedule(engine.free_pages(), hook), reqs

    batch, (old, mid, new) = run(None)  # row 33 needs a third page each
    assert batch.preempted == [new] and batch.reqs == [old, mid]
    calls = []
    batch, (old, mid, new) = run(lambda req: calls.append(req) or (1 if len(calls) == 1 else 2))
    assert calls == [new, mid] and batch.preempted == [new, mid] and batch.reqs == [old]


def test_admit_then_schedule_starts_after_a_cached_prefix() -> None:
    sched = Scheduler(2, prefill_chunk=64, page_size=16)
    req = _req(100)
    sched.add(req)
    assert sched.admit() == [req] and sched.admit() == []
    req.num_cached = 90  # the engine placed a cached prefix of 90 rows
    batch = sched.schedule(free_pages=1)
    assert batch.reqs == [req] and batch.num_tokens == [10]


def test_a_request_with_forks_is_admitted_with_its_seats_and_keeps_them() -> None:
    sched = Scheduler(max_num_seqs=4, prefill_chunk=16)
    first, forking, last = _req(8), _req(8), _req(8)
    forking.num_forks = 2  # n = 3
    sched.add(first)
    sched.add(forking)
    sched.add(last)
    assert sched.admit() == [first, forking]  # 1 + 3 seats of 4: `last` waits
    assert sched.num_seats == 4 and not sched.admit()
    sched.release_seat(forking)
    fork = _req(8)
    sched.add_prefilled(fork)  # the seat goes to the fork
    assert sched.num_seats == 4 and not sched.admit()
    sched.release_seat(forking)  # a fork that went to prefill on its own gives its seat back
    assert sched.admit() == [last] and sched.num_seats == 4
    with pytest.raises(QueueFull):
        sched.add_prefilled(_req(8))
    sched.finish(first)
    sched.finish(forking)  # 2 seats now: fork, last
    pair = _req(8)
    pair.num_forks = 2
    sched.add(pair)
    assert not sched.admit()  # 2 + 3 > 4
    sched.finish(last)
    assert sched.admit() == [pair] and sched.num_seats == 4


def test_drafts_go_last_and_fit_the_rows_and_pages_left() -> None:
    """Decode rows with drafts follow the plain ones (those attend as one batch); drafts are
    cut to the step's rows and the free pages, never preempting anything for them."""
    sched = Scheduler(max_num_seqs=3, prefill_chunk=64, max_batched_tokens=8, page_size=4)
    reqs = [_req(3) for _ in range(3)]
    for req in reqs:
        sched.add(req)
    sched.admit()
    for req in reqs:  # prefilled: 3 rows cached, a token out, the next row decodes
        req.num_cached, req.status = 3, Status.DECODE
        req.output_ids.append(7)
    reqs[0].drafts, reqs[2].drafts = [1, 2, 3, 4, 5, 6], [1, 2]
    # 3 decode rows (each fills its first page's last row); 5 rows of budget left; one free
    # page: the first drafting sequence gets the 4 rows that page holds, the second none
    batch = sched.schedule(free_pages=1)
    assert [len(r.drafts) for r in reqs] == [4, 0, 0]
    assert batch.reqs == [reqs[1], reqs[2], reqs[0]] and batch.num_tokens == [1, 1, 5]
    assert batch.num_decode == 3 and not batch.preempted


def test_a_pinned_request_waits_for_its_slot_and_keeps_its_place() -> None:
    """A request pinned to a slot a running one holds (or is pinned to) is passed over, not
    the requests behind it, and is admitted first once its slot is free."""
    sched = Scheduler(2)
    holder = Sequence([1, 2], SamplingParams(max_tokens=4, slot=1))
    waiting = Sequence([1, 2], SamplingParams(max_tokens=4, slot=1))
    other = _req(2)
    for req in (holder, waiting, other):
        sched.add(req)
    assert sched.admit() == [holder, other]
    assert list(sched.waiting) == [waiting]
    holder.slot = 1  # NOTE: placed by the engine
    assert sched.admit() == [] and sched.pinned_slots() == {1, None}
    later = _req(2)
    sched.add(later)
    sched.remove(holder.uid)
    assert sched.admit() == [waiting] and list(sched.waiting) == [later]
