"""Admission sources: other ways a request's prompt gets prefilled (a prefill worker,
muser/disagg/client.py), registered with the engine (`Engine.add_source`); the engine imports
none of them.

    offer(seq, num_uncached) .. at `Engine.add`, for a request whose prompt may be prefilled
                                elsewhere (one sample, no prompt logprobs): True takes it (its
                                prefill started there; its Arrival comes from done()), False
                                leaves it here
    count_local() ............. a request stays local (for the source's counters)
    cancel(uid) ............... the request was cancelled while its prefill is away
    has_done, done() .......... prefills that finished, well or not, for the engine loop
    stats() ................... counters for metrics

An Arrival installs itself into its waiting sequence: the engine knows no snapshot format.
"""

from __future__ import annotations

from typing import Protocol

import torch

from muser.runner import Runner
from muser.sequence import Sequence


class Arrival(Protocol):
    uid: int

    @property
    def failed(self) -> bool:
        """The prefill failed: the engine prefills the prompt itself."""
        ...

    def install(self, runner: Runner, seq: Sequence) -> torch.Tensor:
        """Place the prefilled prompt into unplaced `seq` on `runner` -> the logits of its last
        row [vocab] (any device). Raises OutOfPages or RuntimeError (no room now: installed
        at a later step), having placed nothing."""
        ...


class Source(Protocol):
    def offer(self, seq: Sequence, num_uncached: int) -> bool: ...

    def count_local(self) -> None: ...

    def cancel(self, uid: int) -> None: ...

    @property
    def has_done(self) -> bool: ...

    def done(self) -> list[Arrival]: ...

    def stats(self) -> dict: ...
