"""Prompt lookup (`--speculative ngram`): drafts copied from the sequence's own tokens.

A sequence whose ids end in ... a b c is drafted what followed the latest earlier occurrence
of its longest suffix in its prompt and outputs: for n = MAX_NGRAM down to MIN_NGRAM, the first
n-gram suffix seen before gives the (at most) k ids after that occurrence. No model runs, so a
draft costs host work only, and a sequence whose suffix was never seen gets none (a plain
decode row). It pays where the continuation repeats its context: an edit of a passage in the
prompt, a quotation, code with one change, a summary that cites.

The index holds, per n, each n-gram's last end position among the ids before the newest one;
every step adds the n-grams ending at the ids the sequence gained (a few dict writes a token).
"""

from __future__ import annotations

from muser.sequence import Sequence

MIN_NGRAM = 2
MAX_NGRAM = 4


class NgramIndex:
    """Where each n-gram (MIN_NGRAM..MAX_NGRAM ids) of a sequence last ended."""

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def draft(self, ids: list[int], k: int) -> list[int]:
        """The ids that followed the latest earlier occurrence of ids' longest seen suffix
        (at most k of them) -> [] when no suffix of MIN_NGRAM ids or more was seen before."""
        last = len(ids) - 1
        for end in range(self.indexed, last):  # NOTE: the newest id's n-grams wait a step
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end + 1 >= n:
                    self.ends[tuple(ids[end + 1 - n:end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if last + 1 < n:
                continue
            end = self.ends.get(tuple(ids[last + 1 - n:]))
            if end is not None:
                return ids[end + 1:end + 1 + k]
        return []


class PromptLookup:
    """The Proposer of `--speculative ngram` (muser/engine/proposer.py)."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if seq.lookup is None:
            seq.lookup = NgramIndex()
        return seq.lookup.draft(seq.all_ids, k)

    def forget(self, seq: Sequence) -> None:
        """Nothing to free: the index lives on the sequence, and stays true across a
        preemption."""
