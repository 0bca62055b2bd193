"""Sequence: one generation request, host only, from its admission to its last output.

It owns everything about the request the engine keeps:

    ids ............... prompt_ids, output_ids (all_ids: both); context_ids: the rows the
                        model sees, all_ids less those a context shift dropped (num_kept rows,
                        then all_ids[num_kept + num_shifted:]; EngineConfig.context_shift)
    sampling state .... sampling (the parameters), seed, constraint (a grammar's host state)
    cache placement ... slot, ring, num_cached, page_ids, token_ids, keys: it *is* a Placement
                        (muser/kvcache/placement.py), so the scheduler reads the same counts the
                        runner commits and the prefix cache restores
    stop state ........ detok (incremental text), stops (stop strings), finish_reason
    output identity ... uid; a fork's `parent` (the request whose uid its outputs carry) and
                        `index` (which of the request's n samples)
    prompt logprobs ... the next prompt position due and those not yet sent
    speculation ....... drafts (this step's proposals to verify), lookup / draft and drafting
                        (the proposer's and the adaptive draft length's state,
                        muser/engine/speculation.py), num_drafted / num_accepted (its counts)

The runner keeps device tensors only (the pool, keyed by slot and page ids); nothing here is a
tensor, so the scheduler and its tests need no torch.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from muser.core import Logprobs, SamplingParams, Status
from muser.kvcache.placement import Placement
from muser.stopping import StopMatcher
from muser.tokenizer import IncrementalDecoder

_uids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence(Placement):
    prompt_ids: list[int]
    sampling: SamplingParams
    uid: int = field(default_factory=lambda: next(_uids))
    output_ids: list[int] = field(default_factory=list)
    num_reused: int = 0  # prompt rows found in the prefix cache when first admitted
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    seed: int = 0  # the draws' seed (the engine's: SamplingParams.seed, or a fresh one)
    constraint: Any = None  # muser.constraint.Constraint when sampling.grammar is set (host)
    num_forks: int = 0  # samples still to fork from this one once its prompt is prefilled
    max_chunk: int | None = None  # most prefill rows per step (None: the scheduler's chunk)
    parent: int | None = None  # a fork: the uid of the request it is a sample of
    index: int = 0  # which sample of its request
    detok: IncrementalDecoder | None = None  # set when the engine takes the request
    stops: StopMatcher | None = None
    next_prompt_lp: int = 1  # the next prompt position whose logprob is due
    prompt_lps: list[Logprobs] = field(default_factory=list)  # not yet sent
    drafts: list[int] = field(default_factory=list)  # proposed to follow its decode row now
    lookup: Any = None  # muser.engine.lookup.NgramIndex (prompt lookup's index of its ids)
    drafting: Any = None  # muser.engine.speculation.Drafting (its draft length's state)
    draft: Any = None  # muser.engine.draft_model.DraftKV (its rows in the draft model's cache)
    num_drafted: int = 0  # draft tokens verified for it
    num_accepted: int = 0  # of those, accepted (outputs that came from a draft)
    num_kept: int = 0  # context shift: the leading rows a shift keeps (n_keep, BOS included)
    num_shifted: int = 0  # context shift: the rows after them dropped so far, oldest first

    @property
    def prompt_end(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_uid(self) -> int:
        """The uid its outputs carry (a fork's: its request's)."""
        return self.uid if self.parent is None else self.parent

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        """Rows to compute before the next token: the prompt's uncached rest while prefilling,
        the last token while decoding, the context (prompt + outputs, less what a context shift
        dropped) when recomputed after a preemption or a shift."""
        return self.num_prompt + len(self.output_ids) - self.num_shifted - self.num_cached

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def context_ids(self) -> list[int]:
        """The ids of the rows the model sees, at positions 0, 1, ...: all_ids until a context
        shift drops some."""
        if not self.num_shifted:
            return self.all_ids
        ids = self.all_ids
        return ids[:self.num_kept] + ids[self.num_kept + self.num_shifted:]

    def next_rows(self, n: int) -> list[int]:
        """The ids of the next `n` rows to compute (context_ids[num_cached:][:n], without joining
        prompt and outputs when the rows lie in one of them)."""
        start, prompt = self.num_cached, self.num_prompt
        if self.num_shifted:
            return self.context_ids[start:start + n]
        if start + n <= prompt:
            return self.prompt_ids[start:start + n]
        if start >= prompt:
            return self.output_ids[start - prompt:start - prompt + n]
        return self.all_ids[start:start + n]
