"""Decode ahead (GPU; EngineConfig.decode_ahead): the next decode step queued on the device
before this step's tokens reach the host.

When every running sequence's next token is due (a decode step, or the step that ends the
prompts it carries) and nothing waits, the next decode step is queued right after this step's
tokens are sampled on the device, fed those tokens (`launch`): the GPU runs it while the host
emits this step's tokens and schedules. Its rows are pending until the host knows the tokens
(`known`), then each is committed to its sequence when the next step takes it as computed
(`take`), or when the sequence leaves first (`settle`: finished, cancelled, preempted), so a
sequence's cache and final prefix checkpoint hold the row either way. Until then the
scheduler sees the row as still to compute, its page as still to take (`held`).

A sequence that stops on its token had that row computed in vain (it stays in its cache, and in
its final prefix checkpoint).
"""

from __future__ import annotations

import torch

from muser.runner import Ahead, Runner
from muser.scheduler import Batch, Scheduler
from muser.sequence import Sequence


class DecodeAhead:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._step: Ahead | None = None
        self._pending: dict[int, tuple[int, int]] = {}  # a sequence's uid -> (row, token)

    def __len__(self) -> int:
        """Rows computed ahead, not yet committed."""
        return len(self._pending)

    def launch(self, batch: Batch, seqs: list[Sequence], tokens: torch.Tensor,
               scheduler: Scheduler, arrivals: bool, max_model_len: int) -> list[int]:
        """After sampling `tokens` [len(seqs)] (on the device) for the due `seqs`: queue the
        next decode step when all of `batch` is due and nothing waits (no queued request, no
        prefill arrival, no prompt left out of the batch). Sequences sure to stop at this token
        (length, context) are left out; one stopped by its token (EOS, a stop string, a
        grammar) has its row computed in vain -> the indices in `seqs` of its sequences."""
        if len(seqs) != len(batch.reqs) or scheduler.waiting or arrivals:
            return []
        scheduled = {id(req) for req in batch.reqs}
        if any(id(req) not in scheduled for req in scheduler.prefilling):
            return []
        going = [i for i, seq in enumerate(seqs)
                 if len(seq.output_ids) + 1 < seq.sampling.max_tokens
                 and seq.num_cached + 1 < max_model_len]
        chosen = [seqs[i] for i in going]
        runner = self.runner
        if not going or sum(runner.pages_needed(seq, seq.num_cached + 1)
                            for seq in chosen) > runner.pages.num_free:
            return []
        if len(going) < len(seqs):
            tokens = tokens[going]
        self._step = runner.forward_ahead(chosen, tokens)
        return going

    def known(self, tokens: list[int]) -> None:
        """The launched step's tokens reached the host (tokens[i]: its row i's)."""
        self._pending = {seq.uid: (i, token)
                         for i, (seq, token) in enumerate(zip(self._step.seqs, tokens))}

    def pending(self) -> set[int]:
        """The uids of the sequences whose next row is computed ahead (no draft may follow
        it: speculation drafts after a row whose token the host knows)."""
        return set(self._pending)

    def held(self) -> int:
        """Pages the pending rows took: the scheduler counts those rows' pages as still to
        take."""
        return sum(self._step.new_pages[i] for i, _ in self._pending.values())

    def take(self, seq: Sequence, ids: list[int]) -> int | None:
        """`seq` is scheduled to compute `ids`: its row of the launched step, committed now
        (None: it has none)."""
        if seq.uid not in self._pending:
            return None
        if ids != [seq.output_ids[-1]]:
            raise RuntimeError(f"request {seq.output_uid}: scheduled {len(ids)} rows, but its "
                               "next one was computed ahead")
        return self._commit(seq.uid)

    def close(self) -> torch.Tensor | None:
        """After the step's rows were taken: commit any row left (its sequence not scheduled)
        and forget the launched step -> its logits [rows, vocab] (None: none was launched)."""
        for uid in list(self._pending):
            self._commit(uid)
        step, self._step = self._step, None
        return None if step is None else step.logits

    def settle(self, seq: Sequence) -> None:
        """`seq` leaves (finished, cancelled, preempted): commit its pending row first."""
        if seq.uid in self._pending:
            self._commit(seq.uid)
            if not self._pending:
                self._step = None

    def _commit(self, uid: int) -> int:
        i, token = self._pending.pop(uid)
        self.runner.commit_ahead(self._step, i, token)
        return i


def gather(due: list, logits: torch.Tensor | None,
           ahead_logits: torch.Tensor | None) -> torch.Tensor:
    """The due sequences' logits in order (muser/engine/plan.py's Due): row d.row of the step
    launched ahead where d.ahead, else the forward's next d.width due rows (the forward's due
    rows come first in `logits`, in order)."""
    if not any(d.ahead for d in due):
        return logits
    if all(d.ahead for d in due):
        rows = [d.row for d in due]
        return ahead_logits if rows == list(range(len(rows))) else ahead_logits[rows]
    num_ahead, index, j = len(ahead_logits), [], 0
    for d in due:
        if d.ahead:
            index.append(d.row)
        else:
            index += range(num_ahead + j, num_ahead + j + d.width)
            j += d.width
    return torch.cat([ahead_logits, logits[:j]])[index]
