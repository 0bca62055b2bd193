"""The engine: requests in, step outputs out. Drives scheduler -> runner -> sampler -> text."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from muser.core import Request, SamplingParams, Status, StepOutput
from muser.errors import MuserError
from muser.runner import Runner, SeqState
from muser.sampler import Sampler
from muser.scheduler import Batch, Scheduler
from muser.stopping import StopMatcher
from muser.tokenizer import IncrementalDecoder, Tokenizer


class PromptError(MuserError, ValueError):
    """The prompt cannot be served (empty, or longer than the context)."""


@dataclass(slots=True)
class _Live:
    """Per-request state that only the engine sees."""

    req: Request
    seq: SeqState | None
    sampler: Sampler
    detok: IncrementalDecoder
    stops: StopMatcher


class SlotInfo(NamedTuple):
    uid: int
    slot: int | None  # runner slot; None until the first chunk is scheduled
    status: str
    num_prompt: int
    num_cached: int
    num_output: int


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer, scheduler: Scheduler) -> None:
        self.runner, self.tokenizer, self.scheduler = runner, tokenizer, scheduler
        self.max_model_len = runner.engine.max_model_len
        self.live: dict[int, _Live] = {}

    def make_request(self, prompt_ids: list[int], sampling: SamplingParams) -> Request:
        """Validate a prompt -> a new Request (touches no engine state, so any thread may call it).
        Raises PromptError."""
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptError(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                              f"{self.max_model_len} (prompt + at least one new token)")
        return Request(list(prompt_ids), sampling)

    def add(self, req: Request) -> None:
        """Queue a request made by make_request; raises scheduler.QueueFull."""
        self.scheduler.add(req)
        self.live[req.uid] = _Live(req, None, Sampler(req.sampling),
                                   IncrementalDecoder(self.tokenizer),
                                   StopMatcher(req.sampling.stop))

    def add_request(self, prompt_ids: list[int], sampling: SamplingParams) -> Request:
        """Queue a request; raises PromptError or scheduler.QueueFull."""
        req = self.make_request(prompt_ids, sampling)
        self.add(req)
        return req

    def slots(self) -> list[SlotInfo]:
        """Host-side view of every live request, for /slots and metrics."""
        return [SlotInfo(live.req.uid, live.seq.slot if live.seq else None, live.req.status.value,
                         live.req.num_prompt, live.req.num_cached, len(live.req.output_ids))
                for live in self.live.values()]

    def abort(self, uid: int) -> StepOutput | None:
        """Cancel a request and free its sequence and KV at once."""
        if uid not in self.live:
            return None
        self._release(self.live[uid], "cancelled")
        return StepOutput(uid, None, "", True, "cancelled")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        """Run one scheduled batch (a decode pass or one prefill chunk)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        lives = [self.live[r.uid] for r in batch.reqs]
        for live in lives:
            if live.seq is None:
                live.seq = self.runner.allocate()
        inputs = self._inputs(batch)
        logits = self.runner.forward([live.seq for live in lives], inputs)
        outputs = []
        for live, ids, row in zip(lives, inputs, logits):
            live.req.num_cached += len(ids)
            if live.req.num_prefill_left == 0:
                outputs.append(self._emit(live, live.sampler(row, live.req.all_ids)))
        return outputs

    def run(self, req: Request) -> Iterator[StepOutput]:
        """Drive the engine until `req` finishes, yielding its outputs as they are produced.
        Closing the iterator early cancels the request."""
        try:
            while req.status != Status.FINISHED:
                for out in self.step():
                    if out.uid == req.uid:
                        yield out
        finally:
            self.abort(req.uid)

    def _inputs(self, batch: Batch) -> list[list[int]]:
        if batch.is_prefill:
            req, n = batch.reqs[0], batch.num_tokens[0]
            return [req.prompt_ids[req.num_cached:req.num_cached + n]]
        return [[r.output_ids[-1]] for r in batch.reqs]

    def _emit(self, live: _Live, token: int) -> StepOutput:
        req, p = live.req, live.req.sampling
        now = time.perf_counter()
        req.first_token_s = req.first_token_s or now
        req.status = Status.DECODE
        if token in self.tokenizer.eot_ids and not p.ignore_eos:
            text = live.stops.push(live.detok.flush())[0] + live.stops.flush()
            return self._finish(live, None, text, "stop")
        req.output_ids.append(token)
        text, hit_stop = live.stops.push(live.detok.push(token))
        if hit_stop:
            return self._finish(live, token, text, "stop")
        if len(req.output_ids) >= p.max_tokens or req.num_cached + 1 >= self.max_model_len:
            text += live.stops.push(live.detok.flush())[0] + live.stops.flush()
            return self._finish(live, token, text, "length")
        return StepOutput(req.uid, token, text, False)

    def _finish(self, live: _Live, token: int | None, text: str, reason: str) -> StepOutput:
        live.req.finish_s = time.perf_counter()
        self._release(live, reason)
        return StepOutput(live.req.uid, token, text, True, reason)

    def _release(self, live: _Live, reason: str) -> None:
        live.req.finish_reason = live.req.finish_reason or reason
        self.scheduler.remove(live.req.uid)
        live.req.status = Status.FINISHED
        if live.seq is not None:
            self.runner.free(live.seq)
            live.seq = None
        self.live.pop(live.req.uid, None)
