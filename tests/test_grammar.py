"""Grammar masks on the real 262k vocabulary (the embedded model's tokenizer) and their use in
the batched sampler: constrained rows choose only allowed tokens, other rows are untouched."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from llguidance import LLMatcher

from muser.constraint import GrammarLimits
from muser.core import SamplingParams
from muser.engine import Engine
from muser.grammar import Bitmask, GrammarMasks
from muser.sampler import BatchSampler, SamplingRow
from muser.tokenizer import Tokenizer

CPU = BatchSampler(torch.device("cpu"))
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
# NOTE: its first mask walks the regex (tokens may run past "yes"): tens of ms
SLOW_FIRST = LLMatcher.grammar_from_lark('start: "yes" /(a{100}){100}/')


@pytest.fixture(scope="module")
def masks(gguf_reader: gguf.GGUFReader) -> GrammarMasks:
    return GrammarMasks(Tokenizer.from_gguf(gguf_reader))


def _allowed(bitmask: Bitmask, k: int, vocab: int) -> set[int]:
    words = bitmask.words[k]
    return {t for t in range(vocab) if (int(words[t >> 5]) >> (t & 31)) & 1}


def test_mask_allows_exactly_the_tokens_that_continue_the_grammar(masks: GrammarMasks) -> None:
    tok = masks.tokenizer
    c = masks.compile(LLMatcher.grammar_from_lark('start: "yes" | "no"'))
    allowed = _allowed(masks.masks([c]), 0, tok.vocab_size)
    pieces = {t: tok.token_to_piece(t) for t in allowed}
    assert allowed and all(p and (b"yes".startswith(p) or b"no".startswith(p))
                           for p in pieces.values()), pieces
    assert tok.token_id("yes") in allowed and tok.token_id("no") in allowed
    assert not allowed & tok.eot_ids  # nothing accepted yet: no end of generation
    assert c.consume(tok.token_id("yes")) and c.is_stopped


def test_rows_without_a_grammar_pay_nothing(masks: GrammarMasks) -> None:
    assert masks.masks([None, None]) is None


def test_sampler_holds_constrained_rows_and_leaves_the_others(masks: GrammarMasks) -> None:
    """Random logits, a batch of constrained and free rows (greedy and seeded): the constrained
    rows walk the schema to its end and parse; the free rows' tokens equal a batch without
    any mask."""
    vocab = masks.tokenizer.vocab_size
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    params = [SamplingParams(temperature=0.0, grammar=grammar), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=50, grammar=grammar),
              SamplingParams(temperature=0.0)]
    constraints = [masks.compile(grammar) if p.grammar else None for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    gen = torch.Generator().manual_seed(0)
    for draw in range(40):
        if all(c is None or c.is_stopped for c in constraints):
            break
        logits = torch.randn(len(params), vocab, generator=gen) * 4
        rows = [SamplingRow(p, 11 + b, draw, []) for b, p in enumerate(params)]
        live = [c if c is not None and not c.is_stopped else None for c in constraints]
        bitmask = masks.masks(live)
        tokens = CPU(logits, rows, bitmask)
        free = CPU(logits, rows)
        for b, (c, t) in enumerate(zip(live, tokens)):
            if c is None:
                assert t == free[b]
            else:
                assert t in _allowed(bitmask, bitmask.rows.index(b), vocab)
                assert c.consume(t)
                outputs[b].append(t)
    for b, c in enumerate(constraints):
        if c is not None:
            assert c.is_stopped
            text = masks.tokenizer.decode(outputs[b])
            value = json.loads(text)
            assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99, text


def test_a_grammar_that_does_not_compile_raises(masks: GrammarMasks) -> None:
    from muser.grammar import GrammarError

    with pytest.raises(GrammarError):
        masks.compile(LLMatcher.grammar_from_lark("start: undefined_rule"))


def test_device_unpack_matches_numpys() -> None:
    """The GPU path unpacks the mask words on the device (unpack_bits); it must give the bits
    numpy's little-endian unpack gives the CPU path, sign bit and a partial last word too."""
    import numpy as np

    from muser.sampler import unpack_bits

    gen = torch.Generator().manual_seed(5)
    words = torch.randint(-2**31, 2**31 - 1, (3, 9), dtype=torch.int32, generator=gen)
    words[0, 0] = -1
    words[1, 3] = -2**31
    count = 9 * 32 - 7
    want = np.unpackbits(words.numpy().view(np.uint8), axis=1, count=count, bitorder="little")
    assert torch.equal(unpack_bits(words, count), torch.from_numpy(want))


def test_a_late_mask_ends_its_request_and_leaves_the_others(masks: GrammarMasks) -> None:
    """A mask later than mask_ms: its row may only end (end-of-generation tokens), its
    Constraint fails and takes no more tokens; the next step's on-time rows are exact."""
    from muser.grammar import GrammarMasks as Masks

    late = Masks(masks.tokenizer, GrammarLimits(mask_ms=1e-6))
    late.vocab = masks.vocab  # NOTE: the vocabulary table is built once per test module
    tok, vocab = masks.tokenizer, masks.tokenizer.vocab_size
    c = late.compile(SLOW_FIRST)
    bitmask = late.masks([None, c])
    assert bitmask.rows == [1] and _allowed(bitmask, 0, vocab) == set(tok.eot_ids)
    assert c.failure and "mask" in c.failure and c.is_stopped
    assert not c.consume(tok.token_id("yes"))
    fresh = masks.compile(LLMatcher.grammar_from_lark('start: "yes" | "no"'))
    assert tok.token_id("yes") in _allowed(masks.masks([fresh]), 0, vocab)


def test_check_refuses_what_matches_nothing_or_costs_too_much(masks: GrammarMasks) -> None:
    from muser.constraint import GrammarError, GrammarLimits, compile_constraint

    limits = GrammarLimits()
    slow = LLMatcher.grammar_from_json_schema({"type": "string", "pattern": "^(a{1000}){1000}$"})
    with pytest.raises(GrammarError, match="first token mask took"):
        compile_constraint(masks.vocab, slow, limits, check=True)
    empty = LLMatcher.grammar_from_json_schema({"enum": []})
    with pytest.raises(GrammarError, match="nsatisfiable"):
        compile_constraint(masks.vocab, empty, limits, check=True)
    ok = LLMatcher.grammar_from_json_schema(SCHEMA)
    assert not compile_constraint(masks.vocab, ok, limits, check=True).is_stopped


@pytest.fixture(scope="module")
def llm(gguf_path: Path, masks: GrammarMasks):
    from muser import LLM

    llm = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=2, max_model_len=128,
              prefix_cache=False)
    llm.engine.grammars.vocab = masks.vocab  # NOTE: the vocabulary table, built once
    return llm


@pytest.fixture(scope="module")
def engine(llm) -> Engine:
    return llm.engine


def _serve(engine: Engine, requests: list[SamplingParams]) -> list[list]:
    """Serve the requests together on `engine` -> each one's StepOutputs."""
    prompt = engine.tokenizer.encode("Answer:", add_bos=True)
    seqs = [engine.add_request(prompt, p) for p in requests]
    at = {seq.uid: i for i, seq in enumerate(seqs)}
    outs: list[list] = [[] for _ in seqs]
    while engine.has_work:
        for out in engine.step():
            outs[at[out.uid]].append(out)
    return outs


def test_a_late_mask_ends_its_request_with_an_error_it_carries(engine: Engine) -> None:
    """The engine ends a request whose mask was late with finish reason "error" and words that
    name the budget (no output token: the end-only mask's), not a silent "stop"; an
    unconstrained request of the same steps goes on to its length."""
    limits = engine.grammars.limits
    engine.grammars.limits = GrammarLimits(mask_ms=1)
    try:
        late, free = _serve(engine, [SamplingParams(max_tokens=8, grammar=SLOW_FIRST),
                                     SamplingParams(max_tokens=4, ignore_eos=True)])
    finally:
        engine.grammars.limits = limits
    end = late[-1]
    assert end.finished and end.ends_request and end.finish_reason == "error", late
    assert end.token_id is None
    assert end.error == ("grammar: a token mask took longer than the 1 ms budget "
                         "(--grammar-mask-ms)"), end.error
    assert [o.finish_reason for o in free] == [None, None, None, "length"]
    assert all(o.error is None for o in free)


def test_a_grammar_limit_hit_mid_generation_is_an_error_not_a_stop(engine: Engine) -> None:
    """A regex whose lexer states pass the limit only a few tokens in (its first mask is quick):
    the request ends with "error" and llguidance's reason."""
    grammar = LLMatcher.grammar_from_lark('start: p p /(a{1000}){1000}/\np: "Qz7;" | "Wk2|"')
    limits = engine.grammars.limits
    engine.grammars.limits = GrammarLimits(mask_ms=60_000)
    try:
        (outs,) = _serve(engine, [SamplingParams(max_tokens=32, grammar=grammar)])
    finally:
        engine.grammars.limits = limits
    assert outs[-1].finish_reason == "error" and "lexer" in outs[-1].error, outs[-1]
    assert outs[-1].error.startswith("grammar: ")
    assert all(o.finish_reason is None for o in outs[:-1]) and len(outs) > 3


def test_generate_raises_what_ended_its_request(llm) -> None:
    """LLM.generate does not return a completion cut short by the engine as if it had ended:
    it raises GenerationError with the engine's words."""
    from muser.errors import GenerationError

    limits = llm.engine.grammars.limits
    llm.engine.grammars.limits = GrammarLimits(mask_ms=1)
    try:
        with pytest.raises(GenerationError, match="1 ms budget"):
            llm.generate("Answer:", SamplingParams(max_tokens=8, grammar=SLOW_FIRST))
    finally:
        llm.engine.grammars.limits = limits
    done = llm.generate("Answer:", SamplingParams(max_tokens=3, ignore_eos=True))
    assert done.finish_reason == "length" and len(done.token_ids) == 3
