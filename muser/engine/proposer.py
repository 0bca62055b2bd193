"""The speculative-decoding seam: a Proposer drafts tokens to follow a sequence's decode row.

The step's plan asks the engine's proposer for every decode row it assembles
(muser/engine/plan.py), so a speculation lane (prompt lookup, a draft
model) plugs in here and in the verify step that accepts a prefix of the drafts, without
touching `Engine.step`. The default, NoDraft, proposes nothing: a decode row is the sequence's
last token alone. Until a verifier exists, the plan refuses drafts.
"""

from __future__ import annotations

from typing import Protocol

from muser.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence) -> list[int]:
        """Draft token ids to follow `seq`'s next decode row ([]: none)."""
        ...


class NoDraft:
    """Proposes nothing (plain decoding)."""

    def propose(self, seq: Sequence) -> list[int]:
        return []
