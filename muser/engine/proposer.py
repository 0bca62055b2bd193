"""The speculative-decoding seam: a Proposer drafts tokens to follow a sequence's decode row.

Before each step the engine's Speculation (muser/engine/speculation.py) asks its proposer for
the drafts of every sequence about to decode; the scheduler fits them into the step, the plan
appends them to the sequence's decode row, and the verify step accepts the prefix of them that
the target model itself chooses. Without --speculative the engine has no proposer: a decode row
is the sequence's last token alone. Prompt lookup (`--speculative ngram`) is
muser/engine/lookup.py, a draft model (`--speculative draft`) muser/engine/draft_model.py.
"""

from __future__ import annotations

from typing import Protocol

from muser.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """At most `k` draft token ids to follow `seq`'s ids ([]: none)."""
        ...

    def forget(self, seq: Sequence) -> None:
        """`seq` leaves the batch (finished, cancelled or preempted): what the proposer holds
        for it outside the sequence goes."""
        ...

