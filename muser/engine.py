"""The engine: requests in, step outputs out. Drives scheduler -> runner -> sampler -> text.

One step: newly admitted requests get a sequence (starting after their longest cached prefix,
with the prefix cache) -> the scheduler's batch (decode rows first, then prefill rows;
preempted sequences' KV dropped as they are chosen) -> one runner forward -> the tokens of
every sequence whose rows are all computed, chosen together on the device (one copy to the
host) -> text, stops, finishes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from muser.core import Request, SamplingParams, Status, StepOutput
from muser.disagg.client import RemotePrefill, Result
from muser.disagg.snapshot import install
from muser.errors import MuserError
from muser.kvcache.pages import OutOfPages
from muser.runner import Runner, SeqState
from muser.sampler import BatchSampler, SamplingRow, request_seed
from muser.scheduler import Scheduler
from muser.stopping import StopMatcher
from muser.tokenizer import IncrementalDecoder, Tokenizer


class PromptError(MuserError, ValueError):
    """The prompt cannot be served (empty, or longer than the context)."""


def check_prompt(prompt_ids: list[int], max_model_len: int) -> None:
    """Raise PromptError unless the prompt is non-empty and leaves room for one new token."""
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise PromptError(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                          f"{max_model_len} (prompt + at least one new token)")


@dataclass(slots=True)
class _Live:
    """Per-request state that only the engine sees."""

    req: Request
    seq: SeqState | None
    seed: int
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
        self.sampler = BatchSampler(runner.device)
        self.remote: RemotePrefill | None = None  # prefill workers (muser/disagg/client.py)
        self._woken = threading.Event()
        self.wake: Callable[[], None] = self._woken.set  # a loop waiting for work sets its own
        self._arrived: list[Result] = []  # remote prefills done, not yet installed
        # the token ids whose rows each slot's last sequence left in the prefix cache (what
        # llama-server calls the slot's cache; muser/slot_actions.py saves and erases it)
        self.slot_ids: dict[int, list[int]] = {}

    def make_request(self, prompt_ids: list[int], sampling: SamplingParams,
                     uid: int | None = None) -> Request:
        """Validate a prompt -> a new Request (touches no engine state, so any thread may call it);
        `uid` as the caller numbers its requests, else the next one. Raises PromptError."""
        check_prompt(prompt_ids, self.max_model_len)
        if uid is None:
            return Request(list(prompt_ids), sampling)
        return Request(list(prompt_ids), sampling, uid=uid)

    def add(self, req: Request) -> None:
        """Queue a request made by make_request (a long prompt goes to a prefill worker when
        there are any); raises scheduler.QueueFull."""
        remote = self.remote is not None and self.remote.wants(req.num_prompt)
        if remote:
            req.status = Status.REMOTE
        else:
            self.scheduler.add(req)
            if self.remote is not None:
                self.remote.count_local()
        self.live[req.uid] = _Live(req, None, request_seed(req.sampling),
                                   IncrementalDecoder(self.tokenizer),
                                   StopMatcher(req.sampling.stop))
        if remote:
            self.remote.start(req.uid, req.prompt_ids)

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
        if self.live[uid].req.status == Status.REMOTE and self.remote is not None:
            self.remote.cancel(uid)
        self._release(self.live[uid], "cancelled")
        return StepOutput(uid, None, "", True, "cancelled")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._arrived) or (
            self.remote is not None and self.remote.has_done)

    def step(self) -> list[StepOutput]:
        """Install the remote prefills that arrived, admit waiting requests (their cached
        prefix placed), then run one scheduled step (decode rows and/or prefill chunks) ->
        their outputs."""
        outputs = self._install_arrived() if self.remote is not None else []
        for req in self.scheduler.admit():
            live = self.live[req.uid]
            live.seq = self.runner.allocate(req.all_ids)
            req.num_cached = live.seq.num_cached
            if not req.output_ids:
                req.num_reused = req.num_cached
        batch = self.scheduler.schedule(self.runner.pages.num_free, self._preempt)
        if batch is None:
            return outputs
        lives = [self.live[r.uid] for r in batch.reqs]
        inputs = [r.next_rows(n) for r, n in zip(batch.reqs, batch.num_tokens)]
        done, rows, flat = [], [], 0
        for live, ids in zip(lives, inputs):
            flat += len(ids)
            live.req.num_cached += len(ids)
            if live.req.num_pending == 0:  # every row computed: the next token is due
                done.append(live)
                rows.append(flat - 1)
        # NOTE: every sequence done (a decode step): each one's last row, the runner's default;
        # none done: still one row (never read)
        logits = self.runner.forward([live.seq for live in lives], inputs,
                                     logit_rows=None if len(done) == len(lives) else
                                     rows or [flat - 1])
        if not done:
            return outputs
        tokens = self.sampler(logits, [self._row(live) for live in done])
        return outputs + [self._emit(live, token) for live, token in zip(done, tokens)]

    def _install_arrived(self) -> list[StepOutput]:
        """Verified remote prefills -> sequences admitted for decode (their first token chosen
        from the worker's logits, as a local prefill's would be); failed ones -> the local
        prefill queue; ones without a free slot or pages wait here."""
        self._arrived += self.remote.done()
        waiting, outputs = [], []
        for result in self._arrived:
            live = self.live.get(result.uid)
            if live is None:  # cancelled meanwhile
                continue
            if result.snapshot is None:
                live.req.status = Status.WAITING
                self.scheduler.add(live.req)
                continue
            if len(self.scheduler.running) >= self.scheduler.max_num_seqs:
                waiting.append(result)
                continue
            try:
                live.seq = install(self.runner, result.snapshot, live.req.prompt_ids)
            except (OutOfPages, RuntimeError):
                waiting.append(result)
                continue
            live.req.num_cached = result.snapshot.num_tokens
            self.scheduler.add_prefilled(live.req)
            logits = result.snapshot.logits[None].to(self.runner.device)
            outputs.append(self._emit(live, self.sampler(logits, [self._row(live)])[0]))
        self._arrived = waiting
        return outputs

    def _preempt(self, req: Request) -> int:
        """Drop a preempted request's sequence -> the pages that gave back."""
        live = self.live[req.uid]
        before = self.runner.pages.num_free
        self.runner.free(live.seq)
        live.seq = None
        return self.runner.pages.num_free - before

    @staticmethod
    def _row(live: _Live) -> SamplingRow:
        req, p = live.req, live.req.sampling
        history = req.all_ids if p.repeat_penalty != 1.0 and p.repeat_last_n else []
        outputs = req.output_ids if p.presence_penalty or p.frequency_penalty else []
        return SamplingRow(p, live.seed, len(req.output_ids), history, outputs)

    def run(self, req: Request) -> Iterator[StepOutput]:
        """Drive the engine until `req` finishes, yielding its outputs as they are produced.
        Closing the iterator early cancels the request."""
        try:
            while req.status != Status.FINISHED:
                if not self.has_work:  # NOTE: only remote prefills in flight: wait for one
                    self._woken.wait(0.05)
                    self._woken.clear()
                for out in self.step():
                    if out.uid == req.uid:
                        yield out
        finally:
            self.abort(req.uid)

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
        return StepOutput(req.uid, token, text, False, num_reused=req.num_reused)

    def _finish(self, live: _Live, token: int | None, text: str, reason: str) -> StepOutput:
        live.req.finish_s = time.perf_counter()
        self._release(live, reason)
        return StepOutput(live.req.uid, token, text, True, reason, live.req.num_reused)

    def _release(self, live: _Live, reason: str) -> None:
        live.req.finish_reason = live.req.finish_reason or reason
        self.scheduler.remove(live.req.uid)
        live.req.status = Status.FINISHED
        if live.seq is not None:
            self.slot_ids[live.seq.slot] = list(live.seq.token_ids)
            self.runner.free(live.seq)
            live.seq = None
        self.live.pop(live.req.uid, None)
