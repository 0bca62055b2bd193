"""Embedding requests (SamplingParams.embed): a prompt's final hidden states, pooled, instead
of a token.

A request that asks is prefilled like any prompt, without its cached prefix (every row's state
is computed), in the steps the scheduler gives it. The plan picks the rows of each chunk its
pooling reads (`EmbedRows.add`), the forward returns their final hidden states (after the final
norm: the LM head's input) beside the due rows' logits, and `Pooled.record` folds them into the
request's pooled state, on the device. Once its last prompt row is in, the request finishes
with that state as its one output (StepOutput.embedding), no LM head run and nothing sampled
for it. Normalizing (llama-server's embd_normalize) is the caller's: muser/pooling.py.

    pooling   rows read                    state
    mean      every prompt row             their float64 sum, divided by the length at the end
    last      the last prompt row          that row
    cls       the first (position 0)       that row
    none      every prompt row             the rows, in order (one vector per token)

A preempted request is prefilled again from position 0, and its state restarts with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from muser.sequence import Sequence


@dataclass(slots=True)
class EmbedRows:
    """The forward's rows whose final hidden states an embedding request pools, and whose."""

    rows: list[int] = field(default_factory=list)  # flat rows of the step's forward
    # per chunk: (its sequence, its first index into rows, how many, its first position)
    parts: list[tuple[Sequence, int, int, int]] = field(default_factory=list)

    def add(self, seq: Sequence, ids: list[int], flat: int) -> None:
        """`seq`'s chunk `ids` starts at flat row `flat` (at position seq.num_cached): the rows
        its pooling reads."""
        pooling = seq.sampling.embed
        if pooling is None:
            return
        start, end = seq.num_cached, seq.num_cached + len(ids)
        if pooling in ("mean", "none"):
            rows = range(flat, flat + len(ids))
        elif pooling == "cls":
            rows = range(flat, flat + 1) if start == 0 else range(0)
        else:
            rows = range(flat + len(ids) - 1, flat + len(ids)) if end == seq.num_prompt else (
                range(0))
        self.parts.append((seq, len(self.rows), len(rows), start))
        self.rows += rows


class Pooled:
    """Each embedding request's pooled state so far, on the device, by uid."""

    def __init__(self) -> None:
        self._state: dict[int, torch.Tensor] = {}

    def record(self, rows: EmbedRows, hidden: torch.Tensor) -> list[tuple[Sequence, tuple]]:
        """hidden [len(rows.rows), hidden] float32 of rows.rows -> the requests whose prompt is
        complete now, each with its vectors (float32 bytes), their state dropped."""
        done = []
        for seq, at, n, start in rows.parts:
            part, pooling = hidden[at:at + n], seq.sampling.embed
            if pooling == "mean":
                part = part.sum(0, dtype=torch.float64)
            prev = self._state.get(seq.uid) if start > 0 else None
            if prev is not None and pooling in ("mean", "none"):
                part = prev + part if pooling == "mean" else torch.cat((prev, part))
            if n or prev is None:  # NOTE: cls and last keep the one row they read
                self._state[seq.uid] = part
            if seq.num_cached == seq.num_prompt:  # NOTE: the forward committed the chunk
                done.append((seq, self._vectors(self._state.pop(seq.uid), seq)))
        return done

    def forget(self, uid: int) -> None:
        """A request that ended before its prompt did."""
        self._state.pop(uid, None)

    @staticmethod
    def _vectors(state: torch.Tensor, seq: Sequence) -> tuple[bytes, ...]:
        if seq.sampling.embed == "mean":
            state = (state / seq.num_prompt).float()
        rows = state.cpu().reshape(-1, state.shape[-1]).contiguous()
        return tuple(row.numpy().tobytes() for row in rows)
