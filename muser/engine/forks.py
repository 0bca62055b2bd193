"""n samples of one prompt (SamplingParams.n): the request is prefilled once; when its first
token is due, n - 1 sequences fork from it (Runner.fork: its full pages shared by reference,
its partial page and sliding rings copied), the scheduler having kept their seats since it
admitted the request. Sample i draws from seed + i and walks its own grammar; every sample's
outputs carry the request's uid and index i. A fork that finds no free page or slot prefills
the prompt on its own.

Forks get engine uids of their own (negative: callers number theirs from 0); this file keeps
which belong to which request.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from muser.grammar import GrammarMasks
from muser.kvcache.pages import OutOfPages
from muser.runner import Runner
from muser.scheduler import Scheduler
from muser.sequence import Sequence


class Forks:
    def __init__(self, runner: Runner, scheduler: Scheduler, grammars: GrammarMasks) -> None:
        self.runner, self.scheduler, self.grammars = runner, scheduler, grammars
        self.of: dict[int, list[int]] = {}  # a request's uid -> its forks' engine uids
        self._uids = itertools.count(-1, -1)

    def __len__(self) -> int:
        """Requests with forks still known."""
        return len(self.of)

    def make(self, seq: Sequence, adopt: Callable[[Sequence], None]) -> list[Sequence]:
        """`seq`'s other samples (its prompt just prefilled), each admitted to decode -> those
        forked; one without a free page or slot waits to prefill on its own. `adopt` makes a
        new sequence live in the engine (its stop state, its uid known)."""
        forks = []
        params = dataclasses.replace(seq.sampling, n=1)
        for index in range(seq.sampling.n - seq.num_forks, seq.sampling.n):
            child = Sequence(seq.prompt_ids, params, uid=next(self._uids), seed=seq.seed + index,
                             parent=seq.output_uid, index=index)
            if params.grammar is not None:  # NOTE: each sample walks its own grammar
                child.constraint = self.grammars.compile(params.grammar)
            child.next_prompt_lp = seq.num_prompt  # NOTE: the prompt's are the first sample's
            adopt(child)
            self.of.setdefault(seq.output_uid, []).append(child.uid)
            self.scheduler.release_seat(seq)
            try:
                self.runner.fork(seq, child)
            except (OutOfPages, RuntimeError):
                self.scheduler.add(child, first=True)
                continue
            self.scheduler.add_prefilled(child)
            forks.append(child)
        return forks

    def pop(self, uid: int) -> list[int]:
        """Forget request `uid`'s forks -> their engine uids."""
        return self.of.pop(uid, [])

    def any_live(self, uid: int, live: dict) -> bool:
        """Whether a sample of request `uid` is still in `live`."""
        return uid in live or any(u in live for u in self.of.get(uid, ()))

    def forget_done(self, uid: int, live: dict) -> None:
        """Forget request `uid`'s forks once none of its samples is in `live`."""
        if uid in self.of and not self.any_live(uid, live):
            del self.of[uid]
