"""Constrained decoding: every constrained row's token mask for one engine step (torch).

A request whose SamplingParams.grammar is set gets a Constraint (muser/constraint.py, compiled
in Engine.make_request, off the engine loop). Each step the engine asks GrammarMasks for the
bitmask of the constrained rows only (rows without a grammar pay nothing): [R, ceil(vocab /
32)] int32 words, bit t % 32 of word t // 32 set when token t may come next, computed for the
R rows in parallel on a small thread pool (llguidance releases the GIL) while the device
still runs the step's forward pass. The sampler unpacks it and applies it on the device
(muser/sampler.py: disallowed logits -> -inf). A grammar that has ended (is_stopped) ends the
request.

Each step waits at most GrammarLimits.mask_ms for its masks. A row whose mask is late gets a
mask of end-of-generation only and its Constraint fails, so the request ends at this token
with finish reason "error" and the failure's words for the client (muser/engine/emit.py);
the late computation finishes in the background into that row's own buffer, read by no one.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import NamedTuple

import torch

from muser.constraint import (
    Constraint,
    GrammarError,
    GrammarLimits,
    Vocab,
    compile_constraint,
)
from muser.tokenizer import Tokenizer

__all__ = ["Bitmask", "GrammarError", "GrammarMasks"]

MASK_THREADS = 4


class Bitmask(NamedTuple):
    """The allowed tokens of some rows of a step: rows[i] is row i of words."""

    rows: list[int]  # indices into the step's sampling rows
    words: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on the host


class GrammarMasks:
    """Compiles grammars and computes the step's masks; one per engine."""

    def __init__(self, tokenizer: Tokenizer, limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits or GrammarLimits()
        self.vocab = Vocab(tokenizer)
        self._pool: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._end_only: torch.Tensor | None = None

    @property
    def num_words(self) -> int:
        return self.vocab.num_words

    def compile(self, grammar: str) -> Constraint:
        """llguidance grammar text -> a fresh Constraint; raises GrammarError."""
        return compile_constraint(self.vocab, grammar, self.limits)

    def masks(self, constraints: list[Constraint | None]) -> Bitmask | None:
        """The bitmask of the rows that have a Constraint (None when no row has one)."""
        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        words = torch.empty(len(rows), self.num_words, dtype=torch.int32)
        todo = {}
        for k, r in enumerate(rows):
            c = constraints[r]
            if c.failure is not None:
                words[k] = self._end_mask()
                continue
            if c.scratch is None:
                c.scratch = torch.empty(self.num_words, dtype=torch.int32)
            todo[self._executor().submit(_fill, c.matcher, c.scratch)] = (k, c)
        if todo:
            deadline = time.perf_counter() + self.limits.mask_ms / 1e3
            done, late = cf.wait(todo, timeout=max(0.0, deadline - time.perf_counter()))
            for fut in done:
                k, c = todo[fut]
                if fut.exception() is not None:
                    c.fail(f"the token mask failed: {fut.exception()}")
                    words[k] = self._end_mask()
                else:
                    words[k] = c.scratch
                    if c.matcher.is_error():
                        c.fail(c.matcher.get_error())
            for fut in late:
                k, c = todo[fut]
                c.fail(f"a token mask took longer than the {self.limits.mask_ms:g} ms budget "
                       "(--grammar-mask-ms)")
                c.scratch = None  # NOTE: the late computation still writes its own buffer
                words[k] = self._end_mask()
        return Bitmask(rows, words)

    def _end_mask(self) -> torch.Tensor:
        """End-of-generation tokens only."""
        if self._end_only is None:
            mask = torch.zeros(self.num_words, dtype=torch.int32)
            for t in self.tokenizer.eot_ids:
                mask[t >> 5] |= _bit(t & 31)
            self._end_only = mask
        return self._end_only

    def _executor(self) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(MASK_THREADS, "muser-grammar")
            return self._pool


def _fill(matcher, buf: torch.Tensor) -> None:
    matcher.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)


def _bit(i: int) -> int:
    """Bit i of an int32 word as a signed value (bit 31 is the sign)."""
    return -(1 << 31) if i == 31 else 1 << i
