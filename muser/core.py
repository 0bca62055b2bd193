"""The nouns that flow through the engine: sampling parameters, statuses, step outputs, the
prompt check (torch-free: the server process imports them). A request itself is a
muser.sequence.Sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from muser.errors import MuserError

MAX_LOGPROBS = 20  # most alternatives a token's logprobs may list (OpenAI's bound)
# an embedding request's pooling of its prompt's final hidden states, in llama-server's names:
# their mean, the last token's, the first token's (cls), or every token's (none)
POOLINGS = ("mean", "last", "cls", "none")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # 1 = off; llama.cpp semantics over the last repeat_last_n
    repeat_last_n: int = 64
    # OpenAI semantics over the tokens generated so far: logit -= frequency * count
    # + presence * (count > 0); 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # llama.cpp's scope instead: presence and frequency count the last repeat_last_n ids of
    # prompt + output, as its repeat penalty does
    penalties_over_last_n: bool = False
    seed: int | None = None  # sample i of n draws from seed + i
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # llguidance grammar text (muser/grammar.py): tokens outside it are never chosen, and the
    # request ends when the grammar does; None = unconstrained
    grammar: str | None = None
    # log-softmax of the raw logits (before penalties, filters and temperature): None = off, k =
    # the chosen token's logprob and the k most likely tokens' (0 <= k <= MAX_LOGPROBS)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    n: int = 1  # samples of the prompt (prefilled once, its KV shared by the samples)
    # (token id, bias) pairs added to the logits before anything else; -inf: never chosen
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the most draft tokens a speculating engine may verify for it per step (0: none; None:
    # the engine's --num-speculative-tokens); outputs are the same either way
    speculative: int | None = None
    min_drafts: int = 0  # a shorter draft is not verified (llama-server's speculative.n_min)
    # logprobs of the distribution the token is drawn from (after the mask, biases, penalties,
    # top-k / top-p / min-p and temperature; greedy: the chosen token, probability 1) instead
    # of the raw logits' (llama-server's post_sampling_probs)
    post_sampling: bool = False
    # the sequence slot to run in (llama-server's id_slot; the request waits while another
    # holds it); None: any free one. Its samples (n > 1) take other free slots
    slot: int | None = None
    # emit a prompt-progress output (StepOutput.progress) when the prompt is placed and after
    # each step that computes prompt rows of it (llama-server's return_progress)
    progress: bool = False
    # an embedding request (one of POOLINGS): its prompt is prefilled, nothing is sampled, and
    # its one output carries the pooled final hidden states (StepOutput.embedding); None: a
    # generation
    embed: str | None = None
    # with EngineConfig.context_shift, llama-server's: the prompt tokens after BOS a shift
    # keeps (-1: the whole prompt), and how many it drops after them (0: half of the rest)
    n_keep: int = 0
    n_discard: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1 or (self.max_tokens == 0 and (
                self.prompt_logprobs is not None or self.embed is not None)),
             "max_tokens must be >= 1 (0 only with prompt logprobs or an embedding)"),
            (self.embed is None or self.embed in POOLINGS,
             f"embed: the pooling is one of {', '.join(POOLINGS)}"),
            (self.embed is None or (self.max_tokens == 0 and self.n == 1
                                    and self.prompt_logprobs is None),
             "an embedding request samples nothing: max_tokens 0, n 1, no prompt logprobs"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (all(self.stop), "stop strings must be non-empty"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.n >= 1, "n must be >= 1"),
            (self.n_keep >= -1 and self.n_discard >= 0,
             "n_keep must be >= -1 (the whole prompt), n_discard >= 0"),
            (self.slot is None or self.slot >= 0, "slot must be >= 0"),
            (not self.post_sampling or self.logprobs is not None,
             "post-sampling probabilities need logprobs"),
            (self.speculative is None or self.speculative >= 0,
             "speculative draft tokens must be >= 0"),
            (all(t >= 0 and not math.isnan(b) and b != math.inf for t, b in self.logit_bias),
             "logit_bias: token ids must be >= 0, biases numbers or -inf"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


class Status(Enum):
    REMOTE = "remote"  # its prompt is being prefilled by a prefill worker
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class PromptError(MuserError, ValueError):
    """The prompt cannot be served (empty, or longer than the context)."""


def check_prompt(prompt_ids: list[int], max_model_len: int) -> None:
    """Raise PromptError unless the prompt is non-empty and leaves room for one new token."""
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise PromptError(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                          f"{max_model_len} (prompt + at least one new token)")


class SlotInfo(NamedTuple):
    """One request in the engine, as /slots and the metrics see it (host integers)."""

    uid: int
    slot: int | None  # runner slot; None until the first chunk is scheduled
    status: str
    num_prompt: int
    num_cached: int
    num_output: int


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding's counters since start (muser/engine/speculation.py), for
    /metrics: verify passes (one per sequence and step with drafts), draft tokens verified and
    accepted, accepted per draft position (by_position[i]: the (i + 1)-th drafts accepted)."""

    k: int  # --num-speculative-tokens
    verified: int = 0
    drafted: int = 0
    accepted: int = 0
    by_position: list[int] = field(default_factory=list)

    def copy(self) -> SpecStats:
        return SpecStats(self.k, self.verified, self.drafted, self.accepted,
                         list(self.by_position))


class Logprobs(NamedTuple):
    """One token's log-probability and the `k` most likely tokens' (id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StepOutput:
    uid: int
    token_id: int | None  # None when a request ends without a new token (e.g. cancelled)
    text_delta: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    num_reused: int = 0  # prompt tokens the request found in the prefix cache
    logprobs: Logprobs | None = None  # of token_id, when the request asks
    # with prompt logprobs, in the request's first output: prompt tokens 1.. in order
    prompt_logprobs: tuple[Logprobs, ...] | None = None
    index: int = 0  # which of the request's n samples
    ends_request: bool = True  # finished, and no other sample of the request is still going
    # with finish_reason "error": why, in words for the client, when the request's own grammar
    # ended it (muser/grammar.py: a mask past its budget, a grammar limit hit); None when the
    # engine itself failed
    error: str | None = None
    # speculative decoding, so far for this sample: draft tokens verified, and accepted
    num_drafted: int = 0
    num_accepted: int = 0
    # a prompt-progress report (SamplingParams.progress; token_id None, not finished): prompt
    # rows in the cache now (num_reused of them found in the prefix cache); None: not one
    progress: int | None = None
    # an embedding request's one output (SamplingParams.embed): float32 vectors (native byte
    # order) of the final hidden states pooled, one, or one per prompt token with pooling "none"
    embedding: tuple[bytes, ...] | None = None
