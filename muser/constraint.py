"""A request's grammar, compiled and bounded (torch-free: the HTTP process checks grammars too).

compile_constraint turns llguidance grammar text (Lark, or its JSON grammar form; the server
builds it from JSON schemas and GBNF, muser/server/structured.py) into a Constraint: an
llguidance LLMatcher over the model's vocabulary, advanced on the host by every token the
request accepts. Its cost is bounded by GrammarLimits, in two kinds:

- llguidance's own limits (LLParserLimits), which make the matcher fail cleanly: the grammar's
  size in symbols, the fuel its lexer may spend building the regexes, the lexer states it may
  create, the Earley items of one row and of one step;
- a wall-clock budget for one token mask (mask_ms). NOTE: llguidance's step fuel does not
  count the lexer's first pass over a large regex against the whole vocabulary (a string
  pattern such as (a{1000}){1000} spends seconds there within every fuel limit), so the mask
  is also timed: muser/grammar.py gives each step's masks mask_ms and ends a request whose
  mask is late. The first mask is computed when the grammar is checked (check=True), off any
  engine step, and a grammar whose first mask costs more than half the budget is refused.
  That check counts the CPU time of the checking thread, not the wall clock: it asks what the
  grammar costs, and a loaded machine (the checking processes run at a lower priority than
  the streams) must not turn a cheap grammar away.

The vocabulary table (LLTokenizer) costs 1.5-4 s for Gemma 3's 262k tokens (a loaded 2-core
CPU), holding the GIL much of that time: built once per process, by the first caller of
Vocab.get; the server and the engine process both build it at startup.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from muser.errors import MuserError
from muser.tokenizer import Tokenizer

log = logging.getLogger("muser.grammar")


class GrammarError(MuserError, ValueError):
    """A grammar that llguidance cannot compile, that matches nothing, or that is too costly."""


@dataclass(frozen=True)
class GrammarLimits:
    """How much one grammar may cost (the `muser serve` --grammar-* flags)."""

    max_size: int = 100_000  # symbols in the grammar's productions (llguidance: 500k)
    lexer_fuel: int = 50_000  # regex building, ~50k a ms (llguidance: 1M)
    step_fuel: int = 200_000  # the lexer's work in one mask step, ~14k a ms
    step_items: int = 50_000  # Earley items in one mask step
    lexer_states: int = 50_000  # distinct lexer states, 1-2 kB each (llguidance: 250k)
    compile_s: float = 2.0  # wall clock for compiling and checking one grammar
    mask_ms: float = 50.0  # wall clock for one token mask on an engine step

    def parser_limits(self):
        import llguidance

        return llguidance.LLParserLimits(
            max_grammar_size=self.max_size, initial_lexer_fuel=self.lexer_fuel,
            step_lexer_fuel=self.step_fuel, step_max_items=self.step_items,
            max_lexer_states=self.lexer_states, verbose_errors=False)


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


class Vocab:
    """A tokenizer's LLTokenizer, built once, on first use, by whichever thread asks first."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._llg = None
        self._lock = threading.Lock()

    @property
    def num_words(self) -> int:
        return (self.tokenizer.vocab_size + 31) // 32

    def get(self):
        with self._lock:
            if self._llg is None:
                self._llg = llg_tokenizer(self.tokenizer)
            return self._llg


class Constraint:
    """One request's grammar state (host only). A constraint that failed (its mask was late,
    or llguidance hit a limit) takes no more tokens and counts as stopped."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.failure: str | None = None
        self.scratch = None  # muser/grammar.py's buffer for this row's mask

    def consume(self, token: int) -> bool:
        """Advance by an accepted token -> whether the grammar took it."""
        if self.failure is not None:
            return False
        ok = self.matcher.consume_token(token)
        if self.matcher.is_error():
            self.fail(self.matcher.get_error())
        return ok

    def fail(self, why: str) -> None:
        """End the grammar: the request stops at its next token (logged once)."""
        if self.failure is None:
            self.failure = why
            log.warning("a request's grammar failed and ends it: %s", why)

    @property
    def is_stopped(self) -> bool:
        """The grammar has ended: nothing but end-of-generation can follow."""
        return self.failure is not None or self.matcher.is_stopped()


def compile_constraint(vocab: Vocab, grammar: str, limits: GrammarLimits,
                       check: bool = False) -> Constraint:
    """llguidance grammar text -> a fresh Constraint; raises GrammarError. check: also compute
    the first mask (paying the lexer's first pass here, not on a step) and refuse a grammar
    that fails on it, allows no token, or costs more than half of limits.mask_ms of this
    thread's CPU time."""
    import llguidance

    matcher = llguidance.LLMatcher(vocab.get(), grammar, log_level=0,
                                   limits=limits.parser_limits())
    if matcher.is_error():
        error = _first_line(matcher.get_error())
        raise GrammarError(error + " (--grammar-max-size)" if "grammar size" in error else error)
    if check:
        # NOTE: llguidance computes one matcher's mask on the calling thread, so the
        # thread's CPU time is the mask's cost whatever else the machine runs
        start = time.thread_time()
        mask = matcher.compute_bitmask()
        took_ms = (time.thread_time() - start) * 1e3
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        if not any(mask):
            raise GrammarError("it matches nothing: no token can start it")
        # NOTE: half the budget, so that a grammar let in is not ended on its first step by
        # the noise of a loaded machine
        if took_ms > limits.mask_ms / 2:
            raise GrammarError(f"its first token mask took {took_ms:.0f} ms of CPU time, more "
                               f"than half of the {limits.mask_ms:g} ms a mask may take "
                               "(--grammar-mask-ms)")
    return Constraint(matcher)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "the grammar failed"
