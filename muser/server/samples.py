"""Several samples of one prompt on the OpenAI routes: n and best_of, checked; the best_of
samples ranked; each sample's tokens and logprobs; the echoed prompt's.

The engine prefills the prompt once and forks the samples from it (muser/engine/forks.py);
sample i draws from seed + i. best_of > n keeps the n samples whose tokens have the highest mean
logprob (OpenAI's "highest log probability per token"); usage counts every sample's tokens and
the prompt once."""

from __future__ import annotations

from dataclasses import dataclass

from muser.core import Logprobs, StepOutput
from muser.server.context import ServerContext
from muser.server.errors import ApiError
from muser.server.logprob_shapes import Entry


def check_samples(ctx: ServerContext, n: int, best_of: int | None, stream: bool,
                  n_name: str = "n") -> int:
    """-> how many samples to draw (best_of, else n); a 400 naming the field (n's as the
    route calls it) unless n <= best_of <= the server's limit (--max-n, and the sequence
    slots)."""
    limit = min(ctx.options.max_n, ctx.max_num_seqs)
    for name, value in ((n_name, n), ("best_of", best_of)):
        if value is not None and value > limit:
            raise ApiError(400, f"{name}: at most {limit} samples per request on this server "
                           f"(--max-n {ctx.options.max_n}, {ctx.max_num_seqs} sequence slots)",
                           "invalid_value", name)
    if best_of is None:
        return n
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be >= n ({n})", "invalid_value",
                       "best_of")
    if stream and best_of > n:
        raise ApiError(400, "best_of: a streamed request cannot rank samples (best_of > n)",
                       "invalid_value", "best_of")
    return best_of


@dataclass(slots=True)
class Sample:
    text: str
    entries: list[Entry]  # (token id, logprobs) of each generated token
    finish_reason: str | None

    @property
    def mean_logprob(self) -> float:
        values = [lp.logprob for _, lp in self.entries if lp is not None]
        return sum(values) / len(values) if values else 0.0


def split(outputs: list[StepOutput], num_samples: int) -> list[Sample]:
    """A finished request's outputs -> each sample's text, tokens and finish reason."""
    found = [Sample("", [], None) for _ in range(num_samples)]
    for out in outputs:
        sample = found[out.index]
        sample.text += out.text_delta
        if out.token_id is not None:
            sample.entries.append((out.token_id, out.logprobs))
        if out.finished:
            sample.finish_reason = out.finish_reason
    return found


def best(found: list[Sample], n: int) -> list[Sample]:
    """The n samples with the highest mean logprob per token, best first (all of them, in
    order, when there are n)."""
    if len(found) == n:
        return found
    return sorted(found, key=lambda s: s.mean_logprob, reverse=True)[:n]


def prompt_entries(prompt_ids: list[int], outputs: list[StepOutput]) -> list[Entry]:
    """The echoed prompt's tokens and logprobs (None for the first; all None without them)."""
    lps: tuple[Logprobs, ...] = next(
        (o.prompt_logprobs for o in outputs if o.prompt_logprobs), ())
    return [(t, lps[i - 1] if 0 < i <= len(lps) else None) for i, t in enumerate(prompt_ids)]
