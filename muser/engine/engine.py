"""The engine: requests in, step outputs out. Drives scheduler -> runner -> sampler -> text.

One step (`step`): prefills that arrived from an admission source installed, newly admitted
sequences placed (after their longest cached prefix, with the prefix cache) -> schedule: the
scheduler's batch (decode rows first, then prefill rows; preempted sequences' KV dropped as
they are chosen) made into a StepPlan -> run: one runner forward -> sample: the tokens of every
due sequence, chosen together on the device (one copy to the host) -> emit: text, stops,
finishes.

Its collaborators, each in its own file: n-sample forks (forks.py), prompt logprobs (echo.py),
decode ahead (ahead.py), speculative decoding (speculation.py: the drafts of the sequences
about to decode, proposed before the step is scheduled, verified at the width of the decode
row and its drafts, the accepted ones committed as their tokens are emitted; proposer.py,
lookup.py, draft_model.py), the admission sources that prefill prompts elsewhere (source.py: a
prefill worker's client registers itself), what a token emits (emit.py: text, stops,
finishes), the context shift of a sequence that fills the context (shift.py), and embedding
requests' pooled hidden states (embedding.py: their one output, nothing sampled).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import torch

from muser.core import Logprobs, SamplingParams, SlotInfo, Status, StepOutput, check_prompt
from muser.engine.ahead import DecodeAhead, gather
from muser.engine.draft_model import DraftModel
from muser.engine.echo import ECHO_ROWS, due_prompt_logprobs
from muser.engine.embedding import Pooled
from muser.engine.emit import emit
from muser.engine.forks import Forks
from muser.engine.lookup import PromptLookup
from muser.engine.plan import StepPlan, plan_step
from muser.engine.sampling import launch_sample
from muser.engine.shift import shift
from muser.engine.source import Arrival, Source
from muser.engine.speculation import Speculation, accepted
from muser.grammar import GrammarMasks
from muser.kvcache.pages import OutOfPages
from muser.runner import Runner
from muser.sampler import BatchSampler, request_seed
from muser.scheduler import Scheduler
from muser.sequence import Sequence
from muser.stopping import StopMatcher
from muser.tokenizer import IncrementalDecoder, Tokenizer


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer, scheduler: Scheduler,
                 draft: Runner | None = None) -> None:
        """draft: the draft model's runner, with --speculative draft (muser/startup/draft.py)."""
        self.runner, self.tokenizer, self.scheduler = runner, tokenizer, scheduler
        self.max_model_len = runner.engine.max_model_len
        self.live: dict[int, Sequence] = {}
        self.sampler = BatchSampler(runner.device)
        self.grammars = GrammarMasks(tokenizer)
        self.sources: list[Source] = []
        self._woken = threading.Event()
        self.wake: Callable[[], None] = self._woken.set  # a loop waiting for work sets its own
        self._arrived: list[Arrival] = []  # prefills done elsewhere, not yet installed
        # NOTE: nothing the engine owns may hold the engine (a bound method of it included):
        # LLM() freezes startup's objects for the collector, so a cycle through them is never
        # freed, and a process that makes several LLMs keeps every one
        self.forks = Forks(runner, scheduler, self.grammars)
        self.pooled = Pooled()
        e = runner.engine
        if (e.speculative == "draft") != (draft is not None):
            raise ValueError("a draft model's runner goes with speculative 'draft', and only "
                             "with it")
        proposer = DraftModel(draft, self.sampler) if draft is not None else PromptLookup()
        self.speculation = None if e.speculative == "none" else Speculation(
            proposer, e.num_speculative_tokens, self.max_model_len)
        # the token ids whose rows each slot's last sequence left in the prefix cache (what
        # llama-server calls the slot's cache; muser/slot_actions.py saves and erases it)
        self.slot_ids: dict[int, list[int]] = {}
        # GPU: on where decode steps replay CUDA graphs (EngineConfig.decode_ahead)
        ahead = runner.engine.decode_ahead
        self.decode_ahead = runner.graphs is not None if ahead is None else ahead
        self.ahead = DecodeAhead(runner)

    def make_request(self, prompt_ids: list[int], sampling: SamplingParams,
                     uid: int | None = None, checked: bool = False) -> Sequence:
        """A prompt -> a new Sequence (touches no engine state, so any thread may call it);
        `uid` as the caller numbers its requests, else the next one; its grammar compiled here,
        off the engine loop. Raises PromptError (unless `checked`: the caller ran
        muser.core.check_prompt already) or GrammarError."""
        if not checked:
            check_prompt(prompt_ids, self.max_model_len)
        seq = Sequence(list(prompt_ids), sampling) if uid is None else Sequence(
            list(prompt_ids), sampling, uid=uid)
        if sampling.grammar is not None:
            seq.constraint = self.grammars.compile(sampling.grammar)
        return seq

    def add_source(self, source: Source) -> None:
        """Let `source` prefill the prompts it wants (muser/engine/source.py)."""
        self.sources.append(source)

    def remove_source(self, source: Source) -> None:
        self.sources.remove(source)

    @property
    def remote(self) -> Source | None:
        """The first admission source (whose stats the server reports), or None."""
        return self.sources[0] if self.sources else None

    def add(self, seq: Sequence) -> None:
        """Queue a sequence made by make_request (a prompt with many tokens not cached here
        goes to an admission source that wants it); raises scheduler.QueueFull."""
        p = seq.sampling
        if p.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n = {p.n} samples need as many sequence slots; the engine has "
                             f"{self.scheduler.max_num_seqs}")
        if p.slot is not None and p.slot >= self.scheduler.max_num_seqs:
            raise ValueError(f"slot {p.slot}: the engine's slots are 0 to "
                             f"{self.scheduler.max_num_seqs - 1}")
        seq.num_forks, seq.seed = p.n - 1, request_seed(p)
        if p.prompt_logprobs is not None:
            seq.max_chunk = ECHO_ROWS
        # NOTE: forks, prompt logprobs and embeddings need the prompt's logits, KV or hidden
        # states here
        if (self.sources and p.n == 1 and p.prompt_logprobs is None and p.slot is None
                and p.embed is None):
            uncached = self._uncached(seq.prompt_ids)
            if any(source.offer(seq, uncached) for source in self.sources):
                seq.status = Status.REMOTE
                self._adopt(seq)
                return
        self.scheduler.add(seq)
        for source in self.sources:
            source.count_local()
        self._adopt(seq)

    def _uncached(self, prompt_ids: list[int]) -> int:
        """Tokens of the prompt a local prefill would compute (after a prefix-cache hit)."""
        prefix = self.runner.prefix
        return len(prompt_ids) - (prefix.cached_tokens(prompt_ids) if prefix is not None else 0)

    def _adopt(self, seq: Sequence) -> None:
        """`seq` goes live: its text and stop state start."""
        seq.detok, seq.stops = IncrementalDecoder(self.tokenizer), StopMatcher(seq.sampling.stop)
        self.live[seq.uid] = seq

    def add_request(self, prompt_ids: list[int], sampling: SamplingParams) -> Sequence:
        """Queue a request; raises PromptError or scheduler.QueueFull."""
        seq = self.make_request(prompt_ids, sampling)
        self.add(seq)
        return seq

    def slots(self) -> list[SlotInfo]:
        """Host-side view of every live request, for /slots and metrics."""
        return [SlotInfo(seq.output_uid, seq.slot, seq.status.value, seq.num_prompt,
                         seq.num_cached, len(seq.output_ids)) for seq in self.live.values()]

    def abort(self, uid: int) -> StepOutput | None:
        """Cancel a request (every sample of it) and free its sequences and KV at once."""
        seqs = [self.live[u] for u in [uid, *self.forks.pop(uid)] if u in self.live]
        if not seqs:
            return None
        for seq in seqs:
            if seq.status == Status.REMOTE:
                for source in self.sources:
                    source.cancel(seq.uid)
            self._release(seq, "cancelled")
        return StepOutput(seqs[0].output_uid, None, "", True, "cancelled")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._arrived) or any(
            source.has_done for source in self.sources)

    def step(self) -> list[StepOutput]:
        """Install the prefills that arrived, admit waiting sequences (their cached prefix
        placed), then run one scheduled step (decode rows and/or prefill chunks) -> their
        outputs."""
        outputs = self._install_arrived() if self.sources else []
        outputs += self._place_admitted()
        if self.speculation is not None:
            self.speculation.draft(self.scheduler.decode_ready, self.ahead.pending())
        plan = self._schedule()
        if plan is None:
            return outputs
        logits, embedded = self._run(plan)
        outputs += [self._progress(seq) for seq in plan.batch.reqs[plan.batch.num_decode:]
                    if seq.sampling.progress and not seq.output_ids]
        outputs += [dataclasses.replace(self._finish(seq, None, "", "stop"), embedding=vectors)
                    for seq, vectors in embedded]
        seqs, rows = self._to_sample(plan, outputs)
        if not seqs:
            return outputs
        tokens, lps = self._sample(plan, seqs, logits, rows)
        at = 0
        for seq in seqs:
            width = 1 + len(seq.drafts)
            if width == 1:
                outputs.append(self._emit(seq, tokens[at], lps[at]))
            else:
                outputs += self._emit_verified(seq, tokens[at:at + width], lps[at:at + width])
            at += width
        return outputs

    def _emit_verified(self, seq: Sequence, tokens: list[int], lps: list[Logprobs | None]
                       ) -> list[StepOutput]:
        """A verify pass's tokens (tokens[i]: chosen after the decode row and i drafts) ->
        the outputs of the accepted drafts and the token after them, each row committed as
        its token is emitted, as plain decoding would (up to a stop)."""
        drafts, rows = seq.drafts, seq.next_rows(1) + seq.drafts
        n = accepted(drafts, tokens)
        self.speculation.verified(seq, len(drafts), n)
        seq.drafts = []
        outputs = []
        for row, token, lp in zip(rows[:n + 1], tokens, lps):
            self.runner.accept(seq, row)
            outputs.append(self._emit(seq, token, lp))
            if outputs[-1].finished or seq.status != Status.DECODE:  # NOTE: or it shifted
                break
        if seq.is_placed:
            self.runner.trim(seq)
        return outputs

    def _place_admitted(self) -> list[StepOutput]:
        """Sequences the scheduler admits now get a slot, after their longest cached prefix
        (none for one that wants prompt logprobs or an embedding) -> the first progress reports
        of those that ask for them."""
        admitted = self.scheduler.admit()
        # NOTE: pinned ones first, in their slots; the others in free slots no waiting request
        # is pinned to, while there are such
        wanted = {seq.sampling.slot for seq in self.scheduler.waiting} - {None}
        for seq in sorted(admitted, key=lambda seq: seq.sampling.slot is None):
            p = seq.sampling
            fresh = p.prompt_logprobs is not None or p.embed is not None  # every row computed
            self.runner.allocate(None if fresh else seq.context_ids, seq=seq,
                                 slot=seq.sampling.slot if seq.sampling.slot is not None
                                 else self._spare_slot(wanted))
            if not seq.output_ids:
                seq.num_reused = seq.num_cached
        return [self._progress(seq) for seq in admitted
                if seq.sampling.progress and not seq.output_ids]

    def _progress(self, seq: Sequence) -> StepOutput:
        """A prompt-progress report: the prompt rows in the cache now, no token."""
        return StepOutput(seq.output_uid, None, "", False, num_reused=seq.num_reused,
                          ends_request=False, progress=min(seq.num_cached, seq.num_prompt))

    def _spare_slot(self, wanted: set[int]) -> int | None:
        """The free slot freed last that no waiting request is pinned to (None: any)."""
        return next((slot for slot in reversed(self.runner.free_slots) if slot not in wanted),
                    None)

    def _schedule(self) -> StepPlan | None:
        """The scheduler's next batch as a plan (rows computed ahead taken), or None."""
        batch = self.scheduler.schedule(self.runner.pages.num_free + self.ahead.held(),
                                        self._preempt)
        plan = None if batch is None else plan_step(batch, self.ahead)
        ahead_logits = self.ahead.close()
        if plan is not None:
            plan.ahead_logits = ahead_logits
        return plan

    def _run(self, plan: StepPlan) -> tuple[torch.Tensor | None, list[tuple[Sequence, tuple]]]:
        """This step's forward (prompt logprobs taken from its echo rows, embeddings' pooled
        states from their rows) -> (the logits of the due sequences, in plan.due order; the
        embedding requests whose prompt is in now, with their vectors)."""
        logits, embedded = None, []
        if plan.run:
            logits, hidden = self.runner.forward_hidden(
                plan.run, plan.run_ids, logit_rows=plan.logit_rows, hold=plan.verify,
                hidden_rows=plan.embed.rows if plan.embed.parts else None)
            if plan.echo.rows:
                plan.echo.record(logits[len(plan.forward_due):])
            if plan.embed.parts:
                embedded = self.pooled.record(plan.embed, hidden)
        return gather(plan.due, logits, plan.ahead_logits), embedded

    def _to_sample(self, plan: StepPlan, outputs: list[StepOutput]
                   ) -> tuple[list[Sequence], list[int]]:
        """The due sequences, with the forks of those that have samples to make, less those
        that want no token (max_tokens 0: finished into `outputs`) -> (the sequences to sample,
        each one's first row of the due logits: one verifying drafts has 1 + len(drafts))."""
        due, rows, at = [d.seq for d in plan.due], [], 0
        for d in plan.due:
            rows.append(at)
            at += d.width
        for i, seq in enumerate(list(due)):
            if seq.num_forks:
                forks = self.forks.make(seq, self._adopt)
                due += forks
                rows += [i] * len(forks)
        for seq in [seq for seq in due if seq.sampling.max_tokens == 0]:
            outputs.append(self._finish(seq, None, "", "length"))
        chosen = [(seq, row) for seq, row in zip(due, rows) if seq.sampling.max_tokens]
        return [seq for seq, _ in chosen], [row for _, row in chosen]

    def _sample(self, plan: StepPlan, seqs: list[Sequence], logits: torch.Tensor,
                rows: list[int]) -> tuple[list[int], list[Logprobs | None]]:
        """One token per sequence from its row of `logits` (one per row for a sequence
        verifying drafts), chosen on the device (the next decode step queued ahead there when
        it can) -> the tokens and logprobs on the host, in that order."""
        index = [row + i for seq, row in zip(seqs, rows) for i in range(1 + len(seq.drafts))]
        if index != list(range(len(index))):
            logits = logits[index]
        pending = launch_sample(self.sampler, self.grammars, logits[:len(index)], seqs)
        going = self.ahead.launch(plan.batch, seqs, pending.tokens, self.scheduler,
                                  bool(self._arrived), self.max_model_len) if (
            self.decode_ahead and not plan.verify and not (
                self.speculation is not None and self.speculation.may_draft(seqs))) else []
        tokens, lps = pending.result()
        if going:
            self.ahead.known([tokens[i] for i in going])
        return tokens, lps

    def _install_arrived(self) -> list[StepOutput]:
        """Prefills done elsewhere -> sequences admitted for decode (their first token chosen
        from the arrival's logits, as a local prefill's would be); failed ones -> the local
        prefill queue; ones without a free slot or pages wait here."""
        for source in self.sources:
            self._arrived += source.done()
        waiting, outputs = [], []
        for arrival in self._arrived:
            seq = self.live.get(arrival.uid)
            if seq is None:  # cancelled meanwhile
                continue
            if arrival.failed:
                seq.status = Status.WAITING
                self.scheduler.add(seq)
                continue
            if self.scheduler.num_seats >= self.scheduler.max_num_seqs:
                waiting.append(arrival)
                continue
            try:
                logits = arrival.install(self.runner, seq)
            except (OutOfPages, RuntimeError):
                waiting.append(arrival)
                continue
            self.scheduler.add_prefilled(seq)
            pending = launch_sample(self.sampler, self.grammars,
                                    logits[None].to(self.runner.device), [seq])
            tokens, lps = pending.result()
            outputs.append(self._emit(seq, tokens[0], lps[0]))
        self._arrived = waiting
        return outputs

    def _preempt(self, seq: Sequence) -> int:
        """Drop a preempted sequence's KV -> the pages that gave back."""
        before = self.runner.pages.num_free
        self.ahead.settle(seq)
        self.runner.free(seq)
        if self.speculation is not None:
            self.speculation.forget(seq)
        return self.runner.pages.num_free - before

    def run(self, seq: Sequence) -> Iterator[StepOutput]:
        """Drive the engine until `seq` (each of its samples) finishes, yielding its outputs as
        they are produced. Closing the iterator early cancels the request."""
        try:
            while seq.status != Status.FINISHED or self.forks.any_live(seq.uid, self.live):
                if not self.has_work:  # NOTE: only remote prefills in flight: wait for one
                    self._woken.wait(0.05)
                    self._woken.clear()
                for out in self.step():
                    if out.uid == seq.uid:
                        yield out
        finally:
            self.abort(seq.uid)

    def _emit(self, seq: Sequence, token: int, lp: Logprobs | None = None) -> StepOutput:
        seq.first_token_s = seq.first_token_s or time.perf_counter()
        seq.status = Status.DECODE
        out = emit(seq, token, self.tokenizer.eot_ids, self.max_model_len,
                   self.runner.engine.context_shift)
        if out.full:
            self.ahead.settle(seq)
            shift(self.runner, seq, self.tokenizer.bos_id, self.max_model_len)
        if out.finish_reason is None:
            return self._output(seq, token, out.text, False, None, lp)
        return self._finish(seq, out.token_id, out.text, out.finish_reason,
                            None if out.token_id is None else lp, out.error)

    def _finish(self, seq: Sequence, token: int | None, text: str, reason: str,
                lp: Logprobs | None = None, error: str | None = None) -> StepOutput:
        seq.finish_s = time.perf_counter()
        self._release(seq, reason)
        return self._output(seq, token, text, True, reason, lp, error)

    def _output(self, seq: Sequence, token: int | None, text: str, finished: bool,
                reason: str | None, lp: Logprobs | None,
                error: str | None = None) -> StepOutput:
        uid = seq.output_uid
        return StepOutput(uid, token, text, finished, reason, seq.num_reused, lp,
                          due_prompt_logprobs(seq), seq.index,
                          finished and not self.forks.any_live(uid, self.live), error,
                          seq.num_drafted, seq.num_accepted)

    def _release(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = seq.finish_reason or reason
        self.scheduler.remove(seq.uid)
        seq.status = Status.FINISHED
        if seq.is_placed:
            self.ahead.settle(seq)  # NOTE: its row computed ahead is in its final checkpoint
            self.slot_ids[seq.slot] = list(seq.token_ids)
            self.runner.free(seq)
        if self.speculation is not None:
            self.speculation.forget(seq)
        self.live.pop(seq.uid, None)
        self.pooled.forget(seq.uid)
        self.forks.forget_done(seq.output_uid, self.live)
