"""A prompt through the runner with the prefix cache on: what it found cached, and every row it
computed (the prefix-reuse and host-tier tests compare a hit's rows with a cold run's)."""

from __future__ import annotations

import torch

from muser.runner import Runner


def run_and_decode(runner: Runner, ids: list[int], steps: int) -> tuple[int, torch.Tensor, list[int]]:
    """Prefill `ids` into a sequence allocated for them, then decode `steps` greedy tokens ->
    (rows it found cached, logits of every row it computed, the tokens); the sequence is freed
    (its end checkpointed)."""
    seq = runner.allocate(ids)
    try:
        reused = seq.num_cached
        rows = [runner.forward([seq], [ids[reused:]], all_logits=True).clone()]
        tokens = [int(rows[0][-1].argmax())]
        for _ in range(steps):
            rows.append(runner.forward([seq], [tokens[-1:]]).clone())
            tokens.append(int(rows[-1][-1].argmax()))
        return reused, torch.cat(rows), tokens
    finally:
        runner.free(seq)
