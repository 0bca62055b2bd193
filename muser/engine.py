"""The engine: requests in, step outputs out. Drives scheduler -> runner -> sampler -> text.

One step: newly admitted requests get a sequence (starting after their longest cached prefix,
with the prefix cache) -> the scheduler's batch (decode rows first, then prefill rows;
preempted sequences' KV dropped as they are chosen) -> one runner forward -> the tokens of
every sequence whose rows are all computed, chosen together on the device (one copy to the
host) -> text, stops, finishes.

n samples of one prompt (SamplingParams.n): the request is prefilled once; when its first
token is due, n - 1 sequences fork from it (muser/runner.py: its full pages shared by
reference, its partial page and sliding rings copied), the scheduler having kept their seats
since it admitted the request. Sample i draws from seed + i; every sample's outputs carry the
request's uid and index i. A fork that finds no free page prefills the prompt on its own.

Prompt logprobs: the request is prefilled without its cached prefix, at most ECHO_ROWS rows per
step, and the logits of those rows give each prompt token's logprob (muser/logprobs.py).

Decode ahead (GPU; EngineConfig.decode_ahead): when every running sequence's next token is
due (a decode step, or the step that ends the prompts) and nothing waits, the next decode step
is queued on the device right after this one's tokens are sampled there, fed those tokens,
before they reach the host (`_launch_ahead`); the next call of step() takes those rows as
computed (`_computed`) instead of running them again. A sequence that stops on its token had
that row computed in vain (it stays in its cache, and in its final prefix checkpoint)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from muser import logprobs
from muser.core import Logprobs, Request, SamplingParams, Status, StepOutput, check_prompt
from muser.disagg.client import RemotePrefill, Result
from muser.disagg.snapshot import install
from muser.grammar import GrammarMasks
from muser.kvcache.pages import OutOfPages
from muser.runner import Ahead, Runner, SeqState
from muser.sampler import BatchSampler, Choice, Pending, SamplingRow, request_seed
from muser.scheduler import Scheduler
from muser.stopping import StopMatcher
from muser.tokenizer import IncrementalDecoder, Tokenizer

ECHO_ROWS = 64  # prefill rows per step of a request that wants prompt logprobs


@dataclass(slots=True)
class _Live:
    """Per-request state that only the engine sees."""

    req: Request
    seq: SeqState | None
    seed: int
    detok: IncrementalDecoder
    stops: StopMatcher
    uid: int  # the uid its outputs carry (a fork's: its request's)
    index: int = 0  # which sample of its request
    next_prompt_lp: int = 1  # the next prompt position whose logprob is due
    prompt_lps: list[Logprobs] = field(default_factory=list)  # not yet sent


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
        self.grammars = GrammarMasks(tokenizer)
        self.remote: RemotePrefill | None = None  # prefill workers (muser/disagg/client.py)
        self._woken = threading.Event()
        self.wake: Callable[[], None] = self._woken.set  # a loop waiting for work sets its own
        self._arrived: list[Result] = []  # remote prefills done, not yet installed
        self.forks: dict[int, list[int]] = {}  # a request's uid -> its forks' engine uids
        self._fork_uids = itertools.count(-1, -1)  # NOTE: negative: callers number from 0
        # the token ids whose rows each slot's last sequence left in the prefix cache (what
        # llama-server calls the slot's cache; muser/slot_actions.py saves and erases it)
        self.slot_ids: dict[int, list[int]] = {}
        # the next decode step, queued before this one's tokens reached the host (GPU: on
        # where decode steps replay CUDA graphs; EngineConfig.decode_ahead)
        ahead = runner.engine.decode_ahead
        self.decode_ahead = runner.graphs is not None if ahead is None else ahead
        self._ahead: tuple[list[_Live], Ahead] | None = None

    def make_request(self, prompt_ids: list[int], sampling: SamplingParams,
                     uid: int | None = None) -> Request:
        """Validate a prompt -> a new Request (touches no engine state, so any thread may call it);
        `uid` as the caller numbers its requests, else the next one; its grammar compiled here,
        off the engine loop. Raises PromptError or GrammarError."""
        check_prompt(prompt_ids, self.max_model_len)
        req = Request(list(prompt_ids), sampling) if uid is None else Request(
            list(prompt_ids), sampling, uid=uid)
        if sampling.grammar is not None:
            req.constraint = self.grammars.compile(sampling.grammar)
        return req

    def add(self, req: Request) -> None:
        """Queue a request made by make_request (a prompt with many tokens not cached here
        goes to a prefill worker when there are any); raises scheduler.QueueFull."""
        p = req.sampling
        if p.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n = {p.n} samples need as many sequence slots; the engine has "
                             f"{self.scheduler.max_num_seqs}")
        req.num_forks = p.n - 1
        if p.prompt_logprobs is not None:
            req.max_chunk = ECHO_ROWS
        # NOTE: forks and prompt logprobs need the prompt's logits and KV here
        remote = (self.remote is not None and self.remote.wants(self._uncached(req.prompt_ids))
                  and p.n == 1 and p.prompt_logprobs is None)
        if remote:
            req.status = Status.REMOTE
        else:
            self.scheduler.add(req)
            if self.remote is not None:
                self.remote.count_local()
        self.live[req.uid] = self._new_live(req, request_seed(p), req.uid)
        if remote:
            self.remote.start(req.uid, req.prompt_ids)

    def _uncached(self, prompt_ids: list[int]) -> int:
        """Tokens of the prompt a local prefill would compute (after a prefix-cache hit)."""
        prefix = self.runner.prefix
        return len(prompt_ids) - (prefix.cached_tokens(prompt_ids) if prefix is not None else 0)
    def _new_live(self, req: Request, seed: int, uid: int, index: int = 0) -> _Live:
        return _Live(req, None, seed, IncrementalDecoder(self.tokenizer),
                     StopMatcher(req.sampling.stop), uid, index)

    def add_request(self, prompt_ids: list[int], sampling: SamplingParams) -> Request:
        """Queue a request; raises PromptError or scheduler.QueueFull."""
        req = self.make_request(prompt_ids, sampling)
        self.add(req)
        return req

    def slots(self) -> list[SlotInfo]:
        """Host-side view of every live request, for /slots and metrics."""
        return [SlotInfo(live.uid, live.seq.slot if live.seq else None, live.req.status.value,
                         live.req.num_prompt, live.req.num_cached, len(live.req.output_ids))
                for live in self.live.values()]

    def abort(self, uid: int) -> StepOutput | None:
        """Cancel a request (every sample of it) and free its sequences and KV at once."""
        lives = [self.live[u] for u in [uid, *self.forks.pop(uid, [])] if u in self.live]
        if not lives:
            return None
        for live in lives:
            if live.req.status == Status.REMOTE and self.remote is not None:
                self.remote.cancel(live.req.uid)
            self._release(live, "cancelled")
        return StepOutput(lives[0].uid, None, "", True, "cancelled")

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
            echo = req.sampling.prompt_logprobs is not None
            live.seq = self.runner.allocate(None if echo else req.all_ids)
            req.num_cached = live.seq.num_cached
            if not req.output_ids:
                req.num_reused = req.num_cached
        ahead, self._ahead = self._ahead, None
        batch = self.scheduler.schedule(self.runner.pages.num_free + self._held(ahead),
                                        self._preempt)
        if batch is None:
            return outputs
        lives = [self.live[r.uid] for r in batch.reqs]
        inputs = [r.next_rows(n) for r, n in zip(batch.reqs, batch.num_tokens)]
        computed = self._computed(ahead, lives, inputs)
        done, rows, flat = [], [], 0  # rows: of the forward's logits, or ~(a row of ahead's)
        run_lives, run_inputs = [], []  # what this step's forward computes
        echo_rows, echo_ids, echo_lives = [], [], []  # rows whose next token is a prompt's
        for live, ids, row in zip(lives, inputs, computed):
            start = live.req.num_cached
            live.req.num_cached += len(ids)
            if row is not None:  # NOTE: a decode row, so its next token is due
                done.append(live)
                rows.append(~row)
                continue
            if live.req.sampling.prompt_logprobs is not None:
                for pos in range(max(start, live.next_prompt_lp - 1),
                                 min(start + len(ids), live.req.num_prompt - 1)):
                    echo_rows.append(flat + pos - start)
                    echo_ids.append(live.req.prompt_ids[pos + 1])
                    echo_lives.append(live)
            flat += len(ids)
            run_lives.append(live)
            run_inputs.append(ids)
            if live.req.num_pending == 0:  # every row computed: the next token is due
                done.append(live)
                rows.append(flat - 1)
        logits = self._logits(ahead, run_lives, run_inputs, rows, echo_rows, echo_ids,
                              echo_lives)
        if not done:
            return outputs
        sample_rows = list(range(len(done)))
        for i, live in enumerate(list(done)):
            if live.req.num_forks:
                forks = self._fork(live)
                done += forks
                sample_rows += [i] * len(forks)
        for live in [live for live in done if live.req.sampling.max_tokens == 0]:
            outputs.append(self._finish(live, None, "", "length"))
        chosen = [(live, row) for live, row in zip(done, sample_rows)
                  if live.req.sampling.max_tokens]
        if not chosen:
            return outputs
        picked = [row for _, row in chosen]
        if picked != list(range(len(chosen))):
            logits = logits[picked]
        chosen_lives = [live for live, _ in chosen]
        pending = self._launch_sample(logits[:len(chosen)], chosen_lives)
        going, ahead = self._launch_ahead(batch, chosen_lives, pending.tokens)
        tokens, lps = pending.result()
        if ahead is not None:  # NOTE: before any of them finishes (its KV is then final)
            self.runner.commit_ahead(ahead, [tokens[i] for i in going])
        outputs += [self._emit(live, token, lp) for live, token, lp in zip(chosen_lives, tokens,
                                                                           lps)]
        ahead_lives = [chosen_lives[i] for i in going]
        if any(live.seq is not None for live in ahead_lives):
            self._ahead = (ahead_lives, ahead)
        return outputs

    def _logits(self, ahead, run_lives: list[_Live], run_inputs: list[list[int]],
                rows: list[int], echo_rows: list[int], echo_ids: list[int],
                echo_lives: list[_Live]):
        """This step's forward over `run_lives` (prompt logprobs taken from its echo rows) ->
        the logits of the sequences whose token is due, in `rows` order (~i: row i of the
        step launched ahead)."""
        ran = [r for r in rows if r >= 0]
        logits = None
        if run_lives:
            # NOTE: every sequence done (a decode step): each one's last row, the runner's
            # default; none done (chunks in the middle of prompts): no row, and no LM head
            all_done = len(ran) == len(run_lives) and not echo_rows
            logits = self.runner.forward([live.seq for live in run_lives], run_inputs,
                                         logit_rows=None if all_done else ran + echo_rows)
            if echo_rows:
                self._prompt_logprobs(logits[len(ran):], echo_ids, echo_lives)
        if len(ran) == len(rows):
            return logits
        if not ran:
            picks = [~r for r in rows]
            return ahead[1].logits if picks == list(range(len(picks))) else (
                ahead[1].logits[picks])
        both = torch.cat([ahead[1].logits, logits[:len(ran)]])
        index, j = [], len(ahead[1].logits)
        for r in rows:
            index.append(~r if r < 0 else j)
            j += r >= 0
        return both[index]

    def _computed(self, ahead, lives: list[_Live], inputs: list[list[int]]) -> list[int | None]:
        """Per scheduled sequence, its row of the step launched ahead (None: not in it)."""
        if ahead is None:
            return [None] * len(lives)
        at = {id(live): i for i, live in enumerate(ahead[0])}
        rows = [at.get(id(live)) for live in lives]
        for live, ids, row in zip(lives, inputs, rows):
            if row is not None and ids != [live.req.output_ids[-1]]:
                raise RuntimeError(f"request {live.uid}: scheduled {len(ids)} rows, but its "
                                   "next one was computed ahead")
        return rows

    @staticmethod
    def _held(ahead) -> int:
        """Pages the step launched ahead took for its live sequences' next rows: the scheduler
        counts those rows' pages as still to take."""
        if ahead is None:
            return 0
        return sum(n for live, seq, n in zip(ahead[0], ahead[1].seqs, ahead[1].new_pages)
                   if live.seq is seq)

    def _launch_ahead(self, batch, lives: list[_Live], tokens) -> tuple[list[int], Ahead | None]:
        """When every running sequence's next token is due now (a decode step, or one that
        ends the prompts it carries: the first decode step is queued as the later ones are)
        and nothing waits, queue the next step on the device, fed the tokens just sampled
        there, before they reach the host: the GPU runs it while the host emits this step's
        tokens and schedules. Sequences sure to stop at this token (length, context) are left
        out; one stopped by its token (EOS, a stop string, a grammar) has its row computed in
        vain. -> (the indices in `lives` of its sequences, the step), or ([], None)."""
        if not self.decode_ahead or len(lives) != len(batch.reqs) or (
                self.scheduler.waiting or self._arrived):
            return [], None
        scheduled = {id(req) for req in batch.reqs}
        if any(id(req) not in scheduled for req in self.scheduler.prefilling):
            return [], None
        going = [i for i, live in enumerate(lives)
                 if len(live.req.output_ids) + 1 < live.req.sampling.max_tokens
                 and live.req.num_cached + 1 < self.max_model_len]
        seqs = [lives[i].seq for i in going]
        if not going or sum(self.runner.pages_needed(seq, seq.num_cached + 1)
                            for seq in seqs) > self.runner.pages.num_free:
            return [], None
        if len(going) < len(lives):
            tokens = tokens[going]
        return going, self.runner.forward_ahead(seqs, tokens)

    def _prompt_logprobs(self, logits, token_ids: list[int], lives: list[_Live]) -> None:
        """Rows of prefill logits -> the logprobs of the prompt tokens they predict."""
        k = max(live.req.sampling.prompt_logprobs for live in lives)
        for live, lp in zip(lives, logprobs.token_logprobs(logits, token_ids, k)):
            top = lp.top[:live.req.sampling.prompt_logprobs]
            live.prompt_lps.append(Logprobs(lp.logprob, top))
            live.next_prompt_lp += 1

    def _fork(self, live: _Live) -> list[_Live]:
        """The request's other n - 1 samples, as sequences forked from its prefilled prompt
        (each admitted to decode); one without a free page waits to prefill on its own."""
        req, forks = live.req, []
        params = dataclasses.replace(req.sampling, n=1)
        for index in range(req.sampling.n - req.num_forks, req.sampling.n):
            child = Request(req.prompt_ids, params, uid=next(self._fork_uids))
            if params.grammar is not None:  # NOTE: each sample walks its own grammar
                child.constraint = self.grammars.compile(params.grammar)
            fork = self._new_live(child, live.seed + index, live.uid, index)
            fork.next_prompt_lp = req.num_prompt  # NOTE: the prompt's are the first sample's
            self.live[child.uid] = fork
            self.forks.setdefault(live.uid, []).append(child.uid)
            try:
                fork.seq = self.runner.fork(live.seq)
            except (OutOfPages, RuntimeError):
                self.scheduler.release_seat(req)
                self.scheduler.add(child, first=True)
                continue
            child.num_cached = fork.seq.num_cached
            self.scheduler.release_seat(req)
            self.scheduler.add_prefilled(child)
            forks.append(fork)
        return forks

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
            if self.scheduler.num_seats >= self.scheduler.max_num_seqs:
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
            tokens, lps = self._sample(logits, [live])
            outputs.append(self._emit(live, tokens[0], lps[0]))
        self._arrived = waiting
        return outputs

    def _preempt(self, req: Request) -> int:
        """Drop a preempted request's sequence -> the pages that gave back."""
        live = self.live[req.uid]
        before = self.runner.pages.num_free
        self.runner.free(live.seq)
        live.seq = None
        return self.runner.pages.num_free - before

    def _sample(self, logits, lives: list[_Live]) -> Choice:
        """One token (and its logprobs, where asked) per live row of logits [len(lives),
        vocab]."""
        return self._launch_sample(logits, lives).result()

    def _launch_sample(self, logits, lives: list[_Live]) -> Pending:
        """As _sample, the tokens left on their way to the host. NOTE: called after the forward
        pass is launched: on a GPU the constrained rows' masks are computed on the host while it
        runs."""
        bitmask = self.grammars.masks([live.req.constraint for live in lives])
        return self.sampler.launch(logits, [self._row(live) for live in lives], bitmask)

    @staticmethod
    def _row(live: _Live) -> SamplingRow:
        req, p = live.req, live.req.sampling
        history = req.all_ids if p.repeat_penalty != 1.0 and p.repeat_last_n else []
        outputs = []
        if p.presence_penalty or p.frequency_penalty:
            outputs = req.output_ids if not p.penalties_over_last_n else (
                req.all_ids[-p.repeat_last_n:] if p.repeat_last_n else [])
        return SamplingRow(p, live.seed, len(req.output_ids), history, outputs)

    def run(self, req: Request) -> Iterator[StepOutput]:
        """Drive the engine until `req` (each of its samples) finishes, yielding its outputs as
        they are produced. Closing the iterator early cancels the request."""
        try:
            while req.status != Status.FINISHED or self._going(req.uid):
                if not self.has_work:  # NOTE: only remote prefills in flight: wait for one
                    self._woken.wait(0.05)
                    self._woken.clear()
                for out in self.step():
                    if out.uid == req.uid:
                        yield out
        finally:
            self.abort(req.uid)

    def _emit(self, live: _Live, token: int, lp: Logprobs | None = None) -> StepOutput:
        req, p = live.req, live.req.sampling
        now = time.perf_counter()
        req.first_token_s = req.first_token_s or now
        req.status = Status.DECODE
        if token in self.tokenizer.eot_ids and not p.ignore_eos:
            text = live.stops.push(live.detok.flush())[0] + live.stops.flush()
            return self._finish(live, None, text, "stop")
        req.output_ids.append(token)
        text, hit_stop = live.stops.push(live.detok.push(token))
        ended = req.constraint is not None and (
            not req.constraint.consume(token) or req.constraint.is_stopped)
        if hit_stop or ended:
            if ended:
                text += live.stops.push(live.detok.flush())[0] + live.stops.flush()
            return self._finish(live, token, text, "stop", lp)
        if len(req.output_ids) >= p.max_tokens or req.num_cached + 1 >= self.max_model_len:
            text += live.stops.push(live.detok.flush())[0] + live.stops.flush()
            return self._finish(live, token, text, "length", lp)
        return self._output(live, token, text, False, None, lp)

    def _finish(self, live: _Live, token: int | None, text: str, reason: str,
                lp: Logprobs | None = None) -> StepOutput:
        live.req.finish_s = time.perf_counter()
        self._release(live, reason)
        return self._output(live, token, text, True, reason, lp)

    def _output(self, live: _Live, token: int | None, text: str, finished: bool,
                reason: str | None, lp: Logprobs | None) -> StepOutput:
        prompt_lps = None
        if live.req.sampling.prompt_logprobs is not None and live.index == 0 and (
                live.next_prompt_lp >= live.req.num_prompt):
            prompt_lps, live.prompt_lps = tuple(live.prompt_lps), []
            live.next_prompt_lp = live.req.num_prompt + 1  # NOTE: sent once
        return StepOutput(live.uid, token, text, finished, reason, live.req.num_reused, lp,
                          prompt_lps or None, live.index, finished and not self._going(live.uid))

    def _going(self, uid: int) -> bool:
        """Whether a sample of request `uid` is still live."""
        return uid in self.live or any(u in self.live for u in self.forks.get(uid, ()))

    def _release(self, live: _Live, reason: str) -> None:
        live.req.finish_reason = live.req.finish_reason or reason
        self.scheduler.remove(live.req.uid)
        live.req.status = Status.FINISHED
        if live.seq is not None:
            self.slot_ids[live.seq.slot] = list(live.seq.token_ids)
            self.runner.free(live.seq)
            live.seq = None
        self.live.pop(live.req.uid, None)
        forks = self.forks.get(live.uid)
        if forks is not None and live.uid not in self.live and not any(
                uid in self.live for uid in forks):
            del self.forks[live.uid]
