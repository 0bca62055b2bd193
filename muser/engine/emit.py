"""A sampled token -> the text it adds and whether its sequence ends there (host only).

    end of turn (EOS/EOT) ... ends with "stop"; the token is not an output, the text held back
                              is flushed (unless ignore_eos)
    a stop string ........... ends with "stop" at the text before it
    the grammar ends ........ (or refuses the token) ends with "stop", the text flushed
    the grammar fails ....... (its mask was late, or llguidance hit a limit) ends with "error"
                              and why ("grammar: ..."), the text flushed; a token chosen on
                              the step whose mask failed is not an output
    max_tokens, context ..... ends with "length", the text flushed; a full context with
                              `shift` goes on instead, `full` set: the engine shifts it first
                              (muser/engine/shift.py)

The sequence's detokenizer and stop matcher hold the text not yet safe to emit (an incomplete
character, a possible stop string's start).
"""

from __future__ import annotations

from typing import NamedTuple

from muser.sequence import Sequence


class Emitted(NamedTuple):
    token_id: int | None  # the output token (None: an end of turn, not an output)
    text: str
    finish_reason: str | None  # None: the sequence goes on
    error: str | None = None  # with "error": why, for the client
    full: bool = False  # the context is full: shift it before its next row


def emit(seq: Sequence, token: int, eot_ids: frozenset[int],
         max_model_len: int, shift: bool = False) -> Emitted:
    """Append `token` to `seq`'s outputs (unless it ends the turn) -> what it emits."""
    failed = grammar_failure(seq)
    if failed is not None:  # NOTE: this step's mask failed: `token` was only a way out
        return Emitted(None, flush(seq), "error", failed)
    if token in eot_ids and not seq.sampling.ignore_eos:
        return Emitted(None, flush(seq), "stop")
    seq.output_ids.append(token)
    text, hit_stop = seq.stops.push(seq.detok.push(token))
    ended = seq.constraint is not None and (
        not seq.constraint.consume(token) or seq.constraint.is_stopped)
    failed = grammar_failure(seq) if ended else None
    if failed is not None:
        return Emitted(token, text + flush(seq), "error", failed)
    if hit_stop or ended:
        return Emitted(token, text + flush(seq) if ended else text, "stop")
    if len(seq.output_ids) >= seq.sampling.max_tokens:
        return Emitted(token, text + flush(seq), "length")
    if seq.num_cached + 1 >= max_model_len:
        return Emitted(token, text, None, full=True) if shift else Emitted(
            token, text + flush(seq), "length")
    return Emitted(token, text, None)


def grammar_failure(seq: Sequence) -> str | None:
    """Why `seq`'s grammar failed, as the client reads it, or None."""
    c = seq.constraint
    return None if c is None or c.failure is None else f"grammar: {c.failure}"


def flush(seq: Sequence) -> str:
    """The text held back, now final."""
    return seq.stops.push(seq.detok.flush())[0] + seq.stops.flush()
