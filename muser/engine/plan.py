"""StepPlan: what one step computes and whose next token it samples, from the scheduler's Batch.

Per scheduled sequence, its next rows (a decode row followed by the drafts the scheduler
kept, muser/engine/speculation.py): a row the step launched ahead computed is taken as
computed (muser/engine/ahead.py); the others go to this step's forward. A sequence is *due*
when its next token follows this step's rows.

    run, run_ids ... the sequences this step's forward appends rows to, and the rows' ids
    due ............ Due(seq, row, ahead, width) per due sequence, in batch order: its row of
                     the step launched ahead (ahead), or of the forward's flat rows; a
                     sequence verifying drafts is due at `width` rows (the decode row and one
                     per draft: each one's token is sampled)
    verify ......... the indices in `run` of the sequences verifying drafts: the forward leaves
                     their rows uncommitted, the engine commits those accepted
    echo ........... the forward's prompt-logprob rows (muser/engine/echo.py)
    embed .......... the forward's rows an embedding request pools (muser/engine/embedding.py);
                     such a request is never due: nothing is sampled for it
    ahead_logits ... the logits of the step launched ahead, whose rows `due` names
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from muser.engine.ahead import DecodeAhead
from muser.engine.echo import EchoRows
from muser.engine.embedding import EmbedRows
from muser.scheduler import Batch
from muser.sequence import Sequence


class Due(NamedTuple):
    seq: Sequence
    row: int
    ahead: bool
    width: int = 1


@dataclass(slots=True)
class StepPlan:
    batch: Batch
    run: list[Sequence] = field(default_factory=list)
    run_ids: list[list[int]] = field(default_factory=list)
    due: list[Due] = field(default_factory=list)
    echo: EchoRows = field(default_factory=EchoRows)
    embed: EmbedRows = field(default_factory=EmbedRows)
    verify: list[int] = field(default_factory=list)
    ahead_logits: torch.Tensor | None = None  # [rows, vocab] of the step launched ahead

    @property
    def forward_due(self) -> list[int]:
        """The forward's flat rows whose logits a due sequence samples from."""
        return [d.row + i for d in self.due if not d.ahead for i in range(d.width)]

    @property
    def logit_rows(self) -> list[int] | None:
        """The forward's rows whose logits are wanted: the due rows, then the echo rows; None
        (the runner's default: each sequence's last row) when every sequence run is due at one
        row and none echoes. NOTE: none due (chunks in the middle of prompts): [], no LM
        head."""
        rows = self.forward_due
        if len(rows) == len(self.run) and not self.echo.rows and not self.verify:
            return None
        return rows + self.echo.rows


def plan_step(batch: Batch, ahead: DecodeAhead) -> StepPlan:
    """The plan of `batch` (rows computed ahead taken, so committed, as it is made)."""
    plan, flat = StepPlan(batch), 0
    for i, (seq, n) in enumerate(zip(batch.reqs, batch.num_tokens)):
        if i < batch.num_decode and n > 1:  # the decode row and its drafts, all sampled
            plan.verify.append(len(plan.run))
            plan.due.append(Due(seq, flat, False, n))
            plan.run.append(seq)
            plan.run_ids.append(seq.next_rows(1) + seq.drafts)
            flat += n
            continue
        ids = seq.next_rows(n)
        row = ahead.take(seq, ids)
        if row is not None:  # NOTE: a decode row, so its next token is due
            plan.due.append(Due(seq, row, True))
            continue
        plan.echo.add(seq, ids, flat)
        plan.embed.add(seq, ids, flat)
        # every row computed: the next token is due (an embedding request wants none)
        due = seq.num_pending == len(ids) and seq.sampling.embed is None
        flat += len(ids)
        plan.run.append(seq)
        plan.run_ids.append(ids)
        if due:
            plan.due.append(Due(seq, flat - 1, False))
    return plan
