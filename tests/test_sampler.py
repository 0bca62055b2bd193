"""The batched sampler against per-row references, its seeded noise, and stop strings."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from muser import sampler
from muser.core import SamplingParams
from muser.ops import native
from muser.sampler import BatchSampler, SamplingRow, request_seed, uniform
from muser.stopping import StopMatcher

CPU = BatchSampler(torch.device("cpu"))


def _rows(params: list[SamplingParams], seed: int = 7, draw: int = 0,
          history: list[int] | None = None) -> list[SamplingRow]:
    return [SamplingRow(p, seed + b, draw, history or []) for b, p in enumerate(params)]


def _logits(num_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _mixed_params(count: int, seed: int = 0) -> list[SamplingParams]:
    """Per-row parameters that cover every filter, on and off, and greedy rows."""
    rng = random.Random(seed)
    return [SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
                           top_k=rng.choice([0, 1, 5, 40, 499, 600]),
                           top_p=rng.choice([1.0, 0.95, 0.6]),
                           min_p=rng.choice([0.0, 0.05, 0.3]),
                           repeat_penalty=rng.choice([1.0, 1.3]))
            for _ in range(count)]


def _reference_survivors(row: torch.Tensor, p: SamplingParams) -> list[int]:
    """The filters of the per-request sampler, one row at a time, in float64."""
    values, ids = torch.sort(row.double(), descending=True)
    k = p.top_k if 0 < p.top_k < row.numel() else row.numel()
    values, ids = values[:k], ids[:k]
    if p.top_p < 1.0:
        cumulative = torch.softmax(values, -1).cumsum(-1)
        keep = int((cumulative < p.top_p).sum()) + 1
        values, ids = values[:keep], ids[:keep]
    probs = torch.softmax(values, -1)
    return sorted(ids[probs >= p.min_p * probs[0]].tolist())


def _reference_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    for b, row in enumerate(rows):
        p = row.params
        if p.repeat_penalty == 1.0 or p.repeat_last_n == 0:
            continue
        for t in set(row.history[-p.repeat_last_n:]):
            x = out[b, t]
            out[b, t] = x / p.repeat_penalty if x > 0 else x * p.repeat_penalty
    for b, row in enumerate(rows):  # then OpenAI's, over the generated tokens
        p = row.params
        for t in set(row.outputs):
            out[b, t] -= p.frequency_penalty * row.outputs.count(t)
            out[b, t] -= p.presence_penalty
    return out


def test_greedy_is_torch_argmax_first_index_on_ties() -> None:
    ties = torch.randint(0, 4, (16, 1000), generator=torch.Generator().manual_seed(3)).float()
    logits = torch.cat([ties, _logits(16, 1000), torch.tensor([[1.0, 3.0, 3.0] + [0.0] * 997])])
    tokens = CPU(logits, _rows([SamplingParams()] * len(logits)))
    assert tokens == [int(torch.argmax(row)) for row in logits]
    assert tokens[-1] == 1


def test_repeat_penalty_matches_a_per_row_loop() -> None:
    rng = random.Random(1)
    logits = _logits(10, 300)
    rows = [SamplingRow(SamplingParams(repeat_penalty=rng.choice([1.0, 0.8, 1.1, 2.0]),
                                       repeat_last_n=rng.choice([0, 1, 3, 64])),
                        0, 0, [rng.randrange(300) for _ in range(rng.randrange(0, 100))])
            for _ in range(10)]
    assert torch.equal(CPU.penalize(logits, rows), _reference_penalty(logits, rows))
    assert CPU(logits, rows) == _reference_penalty(logits, rows).argmax(-1).tolist()
    llama = SamplingRow(SamplingParams(repeat_penalty=2.0), 0, 0, [0, 1, 1])
    assert CPU.penalize(torch.tensor([[2.0, -2.0, 1.0]]), [llama]).tolist() == [[1.0, -4.0, 1.0]]


def test_presence_and_frequency_penalties_match_a_per_row_loop() -> None:
    rng = random.Random(2)
    logits = _logits(12, 300)
    rows = [SamplingRow(SamplingParams(repeat_penalty=rng.choice([1.0, 1.3]),
                                       presence_penalty=rng.choice([0.0, -1.5, 0.5, 2.0]),
                                       frequency_penalty=rng.choice([0.0, 0.25, -2.0])),
                        0, 0, [rng.randrange(300) for _ in range(40)],
                        [rng.randrange(30) for _ in range(rng.randrange(0, 60))])
            for _ in range(12)]
    assert any(r.params.presence_penalty and r.outputs for r in rows)
    # NOTE: penalties exact in float32, so both orders of the same two subtractions agree
    assert torch.equal(CPU.penalize(logits, rows), _reference_penalty(logits, rows))
    openai = SamplingRow(SamplingParams(presence_penalty=0.5, frequency_penalty=1.0), 0, 0, [],
                         [2, 2, 0])
    assert CPU.penalize(torch.zeros(1, 4), [openai]).tolist() == [[-1.5, 0.0, -2.5, 0.0]]


def test_filters_keep_what_they_promise() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])).expand(3, 5)
    params = [SamplingParams(temperature=1, top_k=3), SamplingParams(temperature=1, top_p=0.7),
              SamplingParams(temperature=1, min_p=0.2)]
    _, ids, keep = CPU.filter(logits, _rows(params))
    survivors = [sorted(ids[b][keep[b]].tolist()) for b in range(3)]
    assert survivors == [[0, 1, 2], [0, 1], [0, 1, 2]]  # 0.5 < 0.7 <= 0.75; 0.15 >= 0.2 * 0.5


def test_filters_match_a_per_row_reference_with_mixed_params() -> None:
    logits = _logits(24, 500, seed=2)
    params = _mixed_params(24, seed=2)
    _, ids, keep = CPU.filter(logits, _rows(params))
    for b, p in enumerate(params):
        if not p.is_greedy:
            assert sorted(ids[b][keep[b]].tolist()) == _reference_survivors(logits[b], p), p


def _top_p_rows(vocab: int) -> torch.Tensor:
    """Rows whose top-p (0.95) survivors number a few, thousands, most of the vocabulary, and
    a run of equal logits across the cut, with -inf logits among them."""
    gen = torch.Generator().manual_seed(9)
    rows = torch.randn(4, vocab, generator=gen) * torch.tensor([[6.0], [3.0], [0.1], [1.0]])
    rows[3, :2] = 12.0
    rows[3, 2:700] = 11.0  # the cut falls inside this run: all of it stays
    rows[:, -5:] = float("-inf")
    return rows


def test_top_p_lists_on_the_cpu_hold_every_survivor(monkeypatch) -> None:
    """A top-p row's shortened best-first list (not the whole sorted vocabulary) keeps the
    survivors of the per-row float64 reference (ties aside: it cuts by position), the same ones
    as the whole list, and draws the tokens the whole list draws."""
    vocab = 1 << 18
    logits = _top_p_rows(vocab)
    params = [SamplingParams(temperature=0.8, top_p=0.95),
              SamplingParams(temperature=1, top_p=0.95),
              SamplingParams(temperature=1.2, top_p=0.95, min_p=0.01),
              SamplingParams(temperature=0.5, top_p=0.95)]
    cuts = [sampler._top_p_prefix(logits[b], 0.95)[0] for b in range(4)]
    assert max(cuts[0], cuts[1], cuts[3]) <= 1 << 16 and cuts[2] == vocab, cuts  # flat: all
    _, ids, keep = CPU.filter(logits, _rows(params))
    survivors = [sorted(ids[b][keep[b]].tolist()) for b in range(4)]
    for b in range(3):
        assert survivors[b] == _reference_survivors(logits[b], params[b]), b
    assert set(range(700)) <= set(survivors[3])  # the cut fell in the run of 11.0: all stay
    draws = [SamplingRow(params[b % 4], 21, draw, []) for b, draw in enumerate(range(16))]
    rows = logits[[b % 4 for b in range(16)]]
    shortened = CPU(rows, draws)

    monkeypatch.setattr(sampler, "_top_p_prefix", lambda row, top_p: (row.numel(), math.nan))
    _, ids, keep = CPU.filter(logits, _rows(params))
    assert [sorted(ids[b][keep[b]].tolist()) for b in range(4)] == survivors
    assert CPU(rows, draws) == shortened


def test_a_top_p_list_too_short_is_listed_whole(monkeypatch) -> None:
    """filter checks each shortened list: one that ends before its cut is replaced by the whole
    row, so the survivors are those of the whole sorted list."""
    logits = _top_p_rows(1 << 16)
    rows = _rows([SamplingParams(temperature=1, top_p=0.95)] * 4)
    estimate = sampler._top_p_prefix
    monkeypatch.setattr(sampler, "_top_p_prefix", lambda row, top_p: (row.numel(), math.nan))
    _, ids, keep = CPU.filter(logits, rows)
    want = [sorted(ids[b][keep[b]].tolist()) for b in range(4)]
    monkeypatch.setattr(sampler, "_top_p_prefix",
                        lambda row, top_p: (16, estimate(row, top_p)[1]))
    _, ids, keep = CPU.filter(logits, rows)
    assert [sorted(ids[b][keep[b]].tolist()) for b in range(4)] == want


def test_seeded_tokens_do_not_depend_on_the_rest_of_the_batch() -> None:
    logits = _logits(8, 2000, seed=4)
    rows = [SamplingRow(p, 100 + b, b, list(range(0, 2000, 7)))
            for b, p in enumerate(_mixed_params(8, seed=5))]
    together = CPU(logits, rows)
    assert together == BatchSampler(torch.device("cpu"))(logits, rows)
    for b in range(8):
        assert CPU(logits[b:b + 1], rows[b:b + 1]) == [together[b]], b


def test_noise_is_nested_splitmix64() -> None:
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    gamma = 0x9E3779B97F4A7C15
    assert mix(gamma) == 0xE220A8397B1DCDAF  # splitmix64's first output from state 0
    seeds, draws = [0, 7, -1, (1 << 63) - 1], [0, 1, 12345, 3]
    ids = [[0, 1, 262143], [5, 6, 7], [0, 99, 100000], [1, 2, 3]]
    got = uniform(sampler.draw_keys(torch.tensor(seeds), torch.tensor(draws)), torch.tensor(ids))
    for b, (seed, draw) in enumerate(zip(seeds, draws)):
        key = mix((mix(seed & mask) + draw * gamma) & mask)
        want = [((mix((key + t * gamma) & mask) >> 12) + 0.5) / 2**52 for t in ids[b]]
        assert got[b].tolist() == want


@pytest.mark.parametrize("width", [7, 500, 1 << 18])
def test_the_cpu_draw_is_the_torch_draw(width: int) -> None:
    """native.gumbel_argmax (one C pass) picks the token of the torch expression the GPU runs,
    on one thread and on two, over lists and over the vocabulary in id order (rows sharing
    one arange), whatever the keep mask; with nothing kept, the first id, as argmax gives."""
    gen = torch.Generator().manual_seed(width)
    rows = 32
    values = torch.randn(rows, width, generator=gen) * 4
    keep = torch.rand(rows, width, generator=gen) < 0.7
    keep[0] = False
    keep[1] = True
    lists = torch.randperm(1 << 18, generator=gen)[:width].expand(rows, width).clone()
    seeds = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen)
    draws = torch.randint(0, 1 << 40, (rows,), generator=gen)
    temperature = torch.tensor([0.3, 0.8, 1.0, 1.7, 0.05, 2.0, 1.0, 0.7] * 4, dtype=torch.float64)
    keys = sampler.draw_keys(seeds, draws)
    threads = torch.get_num_threads()
    for ids in (lists, torch.arange(width).expand(rows, width)):
        want = sampler.gumbel_argmax(values, ids, keep, keys, temperature)
        assert want[0] == ids[0, 0]
        for n in (1, 2):
            torch.set_num_threads(n)
            try:
                got = native.gumbel_argmax(values, ids, keep, keys, temperature)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(got, want), (n, got, want)


def test_the_cpu_bands_are_the_torch_bands() -> None:
    """native.top_p_bands (one C pass) counts what sampler.top_p_bands counts, band for band,
    on exp(row - max) of wide and narrow rows, with -inf logits (relative 0), subnormals and
    exact powers of two at the band edges. The masses are the same float64 terms summed in two
    orders: each sum of n terms >= 0 is within (n - 1) 2^-53 of its total (relative), so the
    two differ by at most twice that."""
    gen = torch.Generator().manual_seed(11)
    for scale in (0.1, 3.0, 40.0):
        row = torch.randn(1 << 18, generator=gen) * scale
        row[:5] = float("-inf")
        relative = torch.exp(row - row.amax())
        relative[5:69] = torch.ldexp(torch.ones(64), -torch.arange(64.0) * 2)  # band edges
        relative[69:74] = torch.tensor([1e-39, 1e-45, 2.0**-126, 2.0**-127, 0.0])  # subnormals
        want_mass, want_count = sampler.top_p_bands(relative)
        mass, count = native.top_p_bands(relative)
        assert torch.equal(count, want_count), scale
        assert count.sum() == relative.numel() and count[126] >= 8
        bound = 2 * (count - 1).clamp(min=0).double() * 2.0**-53 * want_mass
        assert ((mass - want_mass).abs() <= bound).all(), scale


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=9, top_p=0.95, min_p=0.02),  # best-first lists
    SamplingParams(temperature=1.3, min_p=0.03),  # the vocabulary in id order
])
def test_draws_follow_the_filtered_softmax(params: SamplingParams) -> None:
    """N draws of one row with distinct draw counters. Each survivor's count is within a
    Bernstein bound of N p at a false-failure probability of 1e-6 in all; others never occur."""
    n, delta = 30_000, 1e-6
    row = _logits(1, 12, seed=6)[0]
    survivors = _reference_survivors(row, params)
    p = torch.zeros(12, dtype=torch.float64)
    p[survivors] = torch.softmax(row[survivors].double() / params.temperature, -1)
    rows = [SamplingRow(params, 11, draw, []) for draw in range(n)]
    counts = torch.bincount(torch.tensor(CPU(row.expand(n, 12), rows)), minlength=12).double()
    assert counts[p == 0].sum() == 0
    log_term = math.log(2 * len(survivors) / delta)
    variance = n * p * (1 - p)
    bound = log_term / 3 + torch.sqrt(log_term**2 / 9 + 2 * log_term * variance)
    assert ((counts - n * p).abs() <= bound).all(), (counts, n * p, bound)


def test_draw_counters_and_seeds_change_the_token() -> None:
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0)
    by_draw = {CPU(logits, [SamplingRow(params, 5, draw, [])])[0] for draw in range(50)}
    by_seed = {CPU(logits, [SamplingRow(params, seed, 0, [])])[0] for seed in range(50)}
    assert len(by_draw) > 40 and len(by_seed) > 40  # 50 uniform picks of 1000: ~49 distinct


def test_request_seed() -> None:
    assert request_seed(SamplingParams(seed=123)) == 123
    seeds = {request_seed(SamplingParams()) for _ in range(4)}
    assert len(seeds) > 1 and all(0 <= s < 2**31 for s in seeds)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_chooses_the_cpu_tokens() -> None:
    logits = _logits(32, 5000, seed=8)
    rows = [SamplingRow(p, 3 * b, b, list(range(b, 5000, 11)))
            for b, p in enumerate(_mixed_params(32, seed=8))]
    gpu = BatchSampler(torch.device("cuda"))
    assert gpu(logits.cuda(), rows) == CPU(logits, rows)
    for b in range(32):
        assert gpu(logits[b:b + 1].cuda(), rows[b:b + 1]) == CPU(logits[b:b + 1], rows[b:b + 1])


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 2.0}, {"max_tokens": 0},
    {"top_k": -1}, {"repeat_penalty": 0.0}, {"stop": ("",)}, {"presence_penalty": 2.5},
    {"frequency_penalty": -2.1}, {"logit_bias": ((5, math.nan),)},
    {"logit_bias": ((5, math.inf),)}, {"logit_bias": ((-1, 1.0),)},
])
def test_bad_sampling_values_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_a_bias_of_minus_infinity_is_allowed() -> None:
    assert SamplingParams(logit_bias=((5, -math.inf), (6, 2.5))).logit_bias[0][1] == -math.inf


def test_stop_strings_hold_back_partial_matches() -> None:
    stops = StopMatcher(("END", "\n\n"))
    assert stops.push("hello E") == ("hello ", False)
    assert stops.push("N") == ("", False)
    assert stops.push("x") == ("ENx", False)
    assert stops.push(" wor\n") == (" wor", False)
    assert stops.push("\nmore") == ("", True)
    assert StopMatcher(("x",)).push("abc") == ("abc", False)
    tail = StopMatcher(("END",))
    assert tail.push("ok E") == ("ok ", False) and tail.flush() == "E"


def test_post_sampling_logprobs_are_the_distribution_drawn_from() -> None:
    """post_sampling rows report log softmax(survivors / temperature) of the penalized logits:
    top-k 5 at temperature 0.7 is the softmax of the 5 best logits / 0.7; a greedy row its token
    at log 1 = 0 and nothing else; the tokens are those of the same rows without it."""
    torch.manual_seed(0)
    logits = torch.randn(3, 1000) * 3
    plain = [SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=5),
             SamplingParams(temperature=0.0, logprobs=3),
             SamplingParams(temperature=1.0, min_p=0.2, seed=2, logprobs=4)]
    post = [dataclasses.replace(p, post_sampling=True) for p in plain]
    sampler = BatchSampler(torch.device("cpu"))
    before = sampler.choose(logits, [SamplingRow(p, p.seed or 0, 0, []) for p in plain])
    after = sampler.choose(logits, [SamplingRow(p, p.seed or 0, 0, []) for p in post])
    assert after.tokens == before.tokens
    top5 = torch.topk(logits[0].double(), 5)
    want = torch.log_softmax(top5.values / 0.7, 0)
    got = after.logprobs[0]
    assert [i for i, _ in got.top] == top5.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in got.top], dtype=torch.float64), want,
                          atol=1e-6)
    assert got.logprob == dict(got.top)[after.tokens[0]]
    assert after.logprobs[1].logprob == 0.0
    assert after.logprobs[1].top[0] == (after.tokens[1], 0.0)
    assert all(v == -math.inf for _, v in after.logprobs[1].top[1:])
    row = logits[2].double()
    kept = row[torch.exp(row - row.max()) >= 0.2]
    probs = [math.exp(v) for _, v in after.logprobs[2].top if v > -math.inf]
    assert len(probs) == min(4, kept.numel())
    assert math.isclose(probs[0], float(torch.softmax(kept, 0).max()), rel_tol=1e-6)
