"""Stop strings over streamed text: emit only text that cannot be the start of a stop string."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""  # text held back because it may begin a stop string

    def push(self, text: str) -> tuple[str, bool]:
        """Feed new text -> (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            cut = min(i for i, _ in hits)
            emit, self.pending = self.pending[:cut], ""
            return emit, True
        hold = self._partial_suffix()
        emit = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(emit):]
        return emit, False

    def flush(self) -> str:
        """At the end of generation everything held back is real text."""
        text, self.pending = self.pending, ""
        return text

    def _partial_suffix(self) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best
