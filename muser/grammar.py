"""Constrained decoding: a request's grammar (llguidance) as a token mask per step.

A request whose SamplingParams.grammar is set gets a Constraint: an llguidance LLMatcher over
the model's vocabulary, advanced on the host by every token the request accepts. Each step the
engine asks GrammarMasks for the bitmask of the constrained rows only (rows without a grammar
pay nothing): [R, ceil(vocab / 32)] int32 words, bit t % 32 of word t // 32 set when token t
may come next, computed for all R rows in parallel on llguidance's threads (the GIL released),
while the device still runs the step's forward pass. The sampler unpacks it and applies it on
the device (muser/sampler.py: disallowed logits -> -inf). A grammar that has ended
(is_stopped) ends the request. The grammar text is llguidance's (Lark, or its JSON grammar
form); the server builds it from JSON schemas and GBNF (muser/server/structured.py).

The vocabulary table (LLTokenizer) costs 1.5-4 s for Gemma 3's 262k tokens (a loaded 2-core
CPU): built once per engine, on the first constrained request, in the thread that submits it
(Engine.make_request), not on the engine loop.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from muser.errors import MuserError
from muser.tokenizer import Tokenizer


class GrammarError(MuserError, ValueError):
    """A grammar that llguidance cannot compile."""


class Bitmask(NamedTuple):
    """The allowed tokens of some rows of a step: rows[i] is row i of words."""

    rows: list[int]  # indices into the step's sampling rows
    words: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on the host


def llg_tokenizer(tokenizer: Tokenizer):
    """muser's tokenizer -> llguidance's LLTokenizer: token bytes, control tokens marked
    special (a 0xff prefix: they never match grammar text), end-of-generation ids as EOS."""
    import llguidance

    tokens = [tokenizer.token_to_piece(i) for i in range(tokenizer.vocab_size)]
    for i in range(tokenizer.vocab_size):
        if tokenizer.is_special(i):
            tokens[i] = b"\xff" + tokens[i]

    class _Vocab:
        eos_token_id, bos_token_id = tokenizer.eos_id, tokenizer.bos_id

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: bytes) -> list[int]:
            return tokenizer.encode(text.decode("utf-8", "replace"), add_bos=False,
                                    parse_special=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()),
                                  eos_token=sorted(tokenizer.eot_ids))


class Constraint:
    """One request's grammar state (host only)."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def consume(self, token: int) -> bool:
        """Advance by an accepted token -> whether the grammar took it."""
        return self.matcher.consume_token(token)

    @property
    def is_stopped(self) -> bool:
        """The grammar has ended: nothing but end-of-generation can follow."""
        return self.matcher.is_stopped()


class GrammarMasks:
    """Compiles grammars and computes the step's masks; one per engine."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._llg = None
        self._executor = None
        self._lock = threading.Lock()

    @property
    def num_words(self) -> int:
        return (self.tokenizer.vocab_size + 31) // 32

    def compile(self, grammar: str) -> Constraint:
        """llguidance grammar text -> a fresh Constraint; raises GrammarError."""
        import llguidance

        matcher = llguidance.LLMatcher(self._vocab(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher)

    def masks(self, constraints: list[Constraint | None]) -> Bitmask | None:
        """The bitmask of the rows that have a Constraint (None when no row has one)."""
        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        words = torch.empty(len(rows), self.num_words, dtype=torch.int32)
        row_bytes = self.num_words * 4
        if len(rows) == 1:
            constraints[rows[0]].matcher.unsafe_compute_mask_ptr(words.data_ptr(), row_bytes)
        else:
            jobs = [(constraints[r].matcher, k) for k, r in enumerate(rows)]
            self._parallel().unsafe_compute_mask_ptr(jobs, words.data_ptr(), row_bytes,
                                                     len(rows))
        return Bitmask(rows, words)

    def _vocab(self):
        with self._lock:
            if self._llg is None:
                self._llg = llg_tokenizer(self.tokenizer)
            return self._llg

    def _parallel(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor
