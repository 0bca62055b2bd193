"""Speculative decoding is exact: with drafts verified, every token, logit and K/V row is plain
decoding's (the CPU is bitwise at every width), greedy and seeded sampling alike, beside other
sequences' decode rows and prefill chunks, with the sliding ring wrapping under rejections."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest
import torch

from muser import LLM, SamplingParams
from muser.engine.lookup import NgramIndex
from muser.engine.sampling import sampling_rows
from muser.engine.speculation import Speculation, accepted
from muser.runner import Runner
from muser.sequence import Sequence

PASSAGE = ("The keeper climbed the stairs at dusk, lit the lamp, wound the clockwork that "
           "turned the lens, and wrote the hour, the wind and the ships he saw in the log. ")
K = 4


def test_lookup_drafts_what_followed_the_longest_latest_match() -> None:
    index = NgramIndex()
    #       0  1  2  3  4  5  6  7  8  9
    ids = [5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6]
    # "5 6" last ended at 6 (-> 1 2 5 6); "9 5 6" / "x 5 6" longer suffixes were never seen
    assert index.draft(ids, 3) == [1, 2, 5]
    assert index.draft(ids + [7], 8) == [8, 9, 5, 6, 1, 2, 5, 6]  # "5 6 7" at 2, longest
    assert index.draft([1, 2, 3, 4], 4) == []  # nothing seen twice
    assert NgramIndex().draft([3, 3, 3], 2) == [3]  # "3 3" ended at 1: one id after it


def test_accepted_counts_the_drafts_the_target_chose() -> None:
    assert accepted([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted([4, 5], [4, 5, 7]) == 2
    assert accepted([4], [3, 2]) == 0


class _Recorder:
    """Wraps an engine's sampler: the logits each (request seed, draw) was sampled from last
    (the final value of a draw is the row its emitted token came from: draws only grow)."""

    def __init__(self, sampler) -> None:
        self.sampler, self.rows = sampler, {}

    def launch(self, logits: torch.Tensor, rows: list, bitmask=None):
        for i, row in enumerate(rows):
            self.rows[row.seed, row.draw] = logits[i].clone()
        return self.sampler.launch(logits, rows, bitmask)


@pytest.fixture(scope="module")
def llms(gguf_path: Path) -> tuple[LLM, LLM]:
    kw = {"progress": False, "device": "cpu", "max_num_seqs": 4, "max_model_len": 2048}
    return LLM(gguf_path, **kw), LLM(gguf_path, speculative="ngram", num_speculative_tokens=K,
                                     **kw)


def _serve(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
           arrivals: list[int], steps: list | None = None) -> list[tuple[list[int], list]]:
    """Feed prompt i at step arrivals[i] -> per request (tokens, logits rows); `steps` gets
    each step's (sequences verifying drafts, plain decode rows, prefill rows)."""
    engine = llm.engine
    engine.sampler = recorder = _Recorder(engine.sampler)
    schedule = engine._schedule

    def recorded():
        plan = schedule()
        if plan is not None and steps is not None:
            b = plan.batch
            steps.append((len(plan.verify), b.num_decode - len(plan.verify), b.num_prefill_rows))
        return plan

    engine._schedule = recorded
    seqs, step = {}, 0
    try:
        while len(seqs) < len(prompts) or engine.has_work:
            for i, at in enumerate(arrivals):
                if at == step:
                    seqs[i] = engine.add_request(prompts[i], params[i])
            outs = engine.step()
            step += 1
            assert all(not o.finished or o.finish_reason == "length" for o in outs)
    finally:
        engine.sampler, engine._schedule = recorder.sampler, schedule
    results = []
    for i in range(len(prompts)):
        seq = seqs[i]
        results.append((seq.output_ids, [recorder.rows[seq.seed, j]
                                         for j in range(len(seq.output_ids))]))
    return results


def _workload(llm: LLM) -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    copy = llm.encode(PASSAGE * 3 + "Again: " + PASSAGE[:40])
    other = llm.encode("A list of the planets, nearest the sun first: Mercury,")
    long = llm.encode(PASSAGE * 9)  # ~560 rows: prefilled in chunks beside the decodes
    params = [
        SamplingParams(max_tokens=48, ignore_eos=True),
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11,
                       repeat_penalty=1.1, presence_penalty=0.3, logprobs=3),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, top_k=40, seed=5),
        SamplingParams(max_tokens=32, ignore_eos=True, frequency_penalty=0.5),
    ]
    return [copy, copy, other, long], params, [0, 1, 2, 3]


def test_speculation_gives_plain_decodings_tokens_and_logits(llms: tuple[LLM, LLM]) -> None:
    plain, spec = llms
    prompts, params, arrivals = _workload(plain)
    want = _serve(plain, prompts, params, arrivals)
    stats = spec.engine.speculation.stats
    before = (stats.drafted, stats.accepted)
    steps = []
    got = _serve(spec, prompts, params, arrivals, steps)
    drafted, accepted_ = stats.drafted - before[0], stats.accepted - before[1]
    assert drafted > accepted_ > 0, (drafted, accepted_)  # drafts held, and some did not
    # NOTE: several sequences verified in one step, beside plain decode rows and a prompt's chunk
    assert any(v >= 2 for v, _, _ in steps)
    assert any(v and plain and prefill for v, plain, prefill in steps), steps
    for (tokens, rows), (want_tokens, want_rows) in zip(got, want):
        assert tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(rows, want_rows))


def test_speculation_beside_decode_ahead(gguf_path: Path, llms: tuple[LLM, LLM]) -> None:
    """Decode ahead (on by default on a GPU) queues a step before the host knows its tokens,
    so no draft can follow its rows: it holds off while a sequence may draft, and a sequence
    whose row was computed ahead gets none. Same tokens and logits as plain decoding, and the
    drafts still come."""
    plain, _ = llms
    ahead = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=4, max_model_len=2048,
                speculative="ngram", num_speculative_tokens=K, decode_ahead=True)
    assert ahead.engine.decode_ahead
    prompts, params, arrivals = _workload(plain)
    want = _serve(plain, prompts, params, arrivals)
    got = _serve(ahead, prompts, params, arrivals)
    assert ahead.engine.speculation.stats.accepted > 0
    for (tokens, rows), (want_tokens, want_rows) in zip(got, want):
        assert tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(rows, want_rows))


def test_a_request_may_turn_speculation_off(llms: tuple[LLM, LLM]) -> None:
    _, spec = llms
    stats = spec.engine.speculation.stats
    before = stats.drafted
    ids = spec.encode(PASSAGE * 3)
    out = spec.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True, speculative=0))
    assert stats.drafted == before and len(out.token_ids) == 16


def test_no_token_past_a_stop_or_max_tokens(llms: tuple[LLM, LLM]) -> None:
    """Stops inside an accepted run end the request there, as plain decoding does."""
    plain, spec = llms
    ids = plain.encode(PASSAGE * 3 + "Again: The keeper")
    free = plain.generate(ids, SamplingParams(max_tokens=30, ignore_eos=True))
    stop = plain.tokenizer.decode(free.token_ids[5:7])
    for max_tokens, stops in ((30, (stop,)), (7, ()), (1, ())):
        p = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stops)
        a, b = plain.generate(ids, p), spec.generate(ids, p)
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert len(b.token_ids) <= max_tokens


class _Drafts:
    """Drafts that follow the true continuation with probability p, else a random token."""

    def __init__(self, truth: list[int], p: float, vocab: int, seed: int) -> None:
        self.truth, self.p, self.vocab, self.rng = truth, p, vocab, random.Random(seed)

    def __call__(self, at: int, k: int) -> list[int]:
        return [t if self.rng.random() < self.p else self.rng.randrange(self.vocab)
                for t in self.truth[at:at + k]]


def _kv_rows(runner: Runner, seq) -> list[torch.Tensor]:
    """Every layer's K/V rows `seq`'s next row can attend: the window's newest ring rows of
    each sliding layer (logical order), the pages' rows of each full layer."""
    pool, window, ps = runner.pool, runner.cfg.sliding_window, runner.engine.page_size
    ring = torch.tensor(seq.ring.tail(window))
    rows = [pool.rings[i, :, seq.slot, ring] for i in range(pool.rings.shape[0])]
    flat = torch.tensor([p * ps + j for p in seq.page_ids for j in range(ps)][:seq.num_cached])
    pages = pool.pages.flatten(2, 3)  # [full layers, 2, pages * page_size, kv heads, dim]
    return rows + [pages[i, :, flat] for i in range(pages.shape[0])]


def test_a_ring_that_wraps_under_rejections_keeps_plain_decodings_rows(
        llms: tuple[LLM, LLM]) -> None:
    plain, spec = llms
    window = plain.runner.cfg.sliding_window
    prompt = plain.encode(PASSAGE * 16)[:window - 40]  # the ring wraps 40 rows into decoding
    steps = 120
    a = plain.runner.allocate()
    logits = [plain.runner.forward([a], [prompt])[0].clone()]
    truth = [int(logits[0].argmax())]
    for _ in range(steps):
        logits.append(plain.runner.forward([a], [truth[-1:]])[0].clone())
        truth.append(int(logits[-1].argmax()))
    r = spec.runner
    b = r.allocate()
    assert torch.equal(r.forward([b], [prompt])[0], logits[0])
    drafts, done, rejected = _Drafts(truth[1:], 0.6, plain.runner.cfg.vocab_size, 3), 0, 0
    while done < steps:
        d = drafts(done, min(K, steps - done))
        rows = r.forward([b], [[truth[done]] + d], all_logits=True, hold=[0])
        n = accepted(d, truth[done + 1:done + 1 + len(d)])
        rejected += n < len(d)
        for i in range(n + 1):  # rows before the first wrong draft are plain decoding's
            assert torch.equal(rows[i], logits[done + 1 + i])
            r.accept(b, ([truth[done]] + d)[i])
        r.trim(b)
        done += n + 1
    assert rejected > 10 and b.ring.logical_origin > 0  # many rejections, the ring wrapped
    extra = done - steps  # NOTE: the last pass may end past `steps`: plain catches up
    for t in truth[steps:steps + extra]:
        plain.runner.forward([a], [[t]])
    assert a.num_cached == b.num_cached
    assert all(torch.equal(x, y) for x, y in zip(_kv_rows(r, b), _kv_rows(plain.runner, a)))
    assert len(b.page_ids) == -(-b.num_cached // r.engine.page_size)  # rejected rows' pages back
    plain.runner.free(a)
    r.free(b)


def test_drafts_respect_the_requests_limits() -> None:
    class Echo:
        def propose(self, seq: Sequence, k: int) -> list[int]:
            return [7] * k

    spec = Speculation(Echo(), 5, max_model_len=100)
    seqs = [Sequence([1] * 10, SamplingParams(max_tokens=3)),
            Sequence([1] * 10, SamplingParams(max_tokens=50, speculative=2)),
            Sequence([1] * 10, SamplingParams(max_tokens=50, speculative=0)),
            Sequence([1] * 10, SamplingParams(max_tokens=50))]
    seqs[3].num_cached = 95  # 5 positions of context left: the last row sampled is 99
    spec.draft(seqs)
    assert [len(s.drafts) for s in seqs] == [2, 2, 0, 3]
    spec.verified(seqs[1], 2, 0)  # a miss: one token, and no drafts for a step
    spec.draft(seqs[1:2])
    assert seqs[1].drafts == []
    spec.draft(seqs[1:2])
    assert seqs[1].drafts == [7]


def test_verified_tokens_follow_the_targets_distribution(llms: tuple[LLM, LLM]) -> None:
    """N seeded requests at one verify pass (the decode row, then a draft d of moderate
    probability): the first token emitted is a draw from the target's own filtered softmax
    (accepted d or the residual's draw), the second, where d held, from the next row's. Each
    token's count is within a Bernstein bound of its expectation, at a false-failure
    probability of 1e-6 over every bound checked."""
    _, spec = llms
    r, n, delta, top_k = spec.runner, 3000, 1e-6, 12
    prompt = spec.encode(PASSAGE + "The keeper")
    seq = r.allocate()
    r.forward([seq], [prompt[:-1]])
    row0 = r.forward([seq], [prompt[-1:]], hold=[0])[0]
    draft = int(row0.topk(2).indices[1])  # the second most likely: accepted now and then
    rows = r.forward([seq], [[prompt[-1], draft]], all_logits=True, hold=[0])
    r.free(seq)
    assert torch.equal(rows[0], row0)
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=8)
    seqs = [Sequence(list(prompt), dataclasses.replace(params, seed=s), seed=s)
            for s in range(n)]
    tokens = []
    for start in range(0, n, 250):  # NOTE: 500 rows of the 262k vocabulary at a time
        chunk = seqs[start:start + 250]
        for s in chunk:
            s.drafts = [draft]
        logits = rows.repeat(len(chunk), 1)
        tokens += spec.engine.sampler(logits, [row for s in chunk for row in sampling_rows(s)])
    first, second = tokens[0::2], tokens[1::2]
    held = [b for a, b in zip(first, second) if a == draft]

    def target(logits: torch.Tensor) -> torch.Tensor:
        top = logits.double().topk(top_k)
        return torch.zeros_like(logits, dtype=torch.float64).index_put_(
            (top.indices,), torch.softmax(top.values, -1))

    checks = 2 * top_k + 2
    for draws, p in ((first, target(rows[0])), (held, target(rows[1]))):
        m = len(draws)
        counts = torch.bincount(torch.tensor(draws), minlength=p.numel()).double()
        assert counts[p == 0].sum() == 0
        log_term = math.log(2 * checks / delta)
        bound = log_term / 3 + torch.sqrt(log_term**2 / 9 + 2 * log_term * m * p * (1 - p))
        assert ((counts - m * p).abs() <= bound).all()
    assert 0.05 < len(held) / n < 0.95  # the draft was accepted, and rejected, many times


def test_kv_moves_between_rings_of_either_size(llms: tuple[LLM, LLM]) -> None:
    """A snapshot (a slot file's, a remote prefill's) of a window-sized ring installs into a
    speculating engine's window + K ring, and back, giving the same next logits."""
    from muser.kvcache.snapshot import export, install

    plain, spec = llms
    ids = plain.encode(PASSAGE * 16)[:600]  # past the 512-row window: a wrapped ring
    for src, dst in ((plain.runner, spec.runner), (spec.runner, plain.runner)):
        a = src.allocate()
        snap = export(src, a, src.forward([a], [ids[:-1]]))
        b = install(dst, snap, ids[:-1])
        assert b.ring.capacity == dst.pool.ring_capacity != snap.ring.capacity
        assert torch.equal(dst.forward([b], [ids[-1:]]), src.forward([a], [ids[-1:]]))
        src.free(a)
        dst.free(b)
