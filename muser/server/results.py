"""What a finished Generation reports in llama-server's terms: timings, stop type, stop word,
whether the context cut it short."""

from __future__ import annotations

from collections.abc import Sequence

from muser.core import StepOutput
from muser.server.generation import Generation


def timings(gen: Generation) -> dict[str, float]:
    """llama-server's timings: cache_n prompt tokens found in the prefix cache, prompt_n the
    ones computed. Rates of the generation phase are over the tokens after the first (the first
    comes out of the prompt's last step). draft_n / draft_n_accepted: speculative decoding's
    draft tokens verified and accepted, present (as in llama-server) only where drafts were made."""
    t = gen.timings()
    cache_n = gen.num_cached
    prompt_n, prompt_ms = t["prompt_n"] - cache_n, t["prompt_ms"]
    predicted_n, predicted_ms = t["predicted_n"], t["predicted_ms"]
    out = {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
           "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
           "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
           "predicted_n": predicted_n, "predicted_ms": predicted_ms,
           "predicted_per_token_ms": predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0,
           "predicted_per_second": t["predicted_per_second"]}
    if gen.num_drafted:
        out |= {"draft_n": gen.num_drafted, "draft_n_accepted": gen.num_accepted}
    return out


def stop_type(last: StepOutput | None) -> str:
    """'eos' (an end-of-turn token), 'word' (a stop string), 'limit' (n_predict or context)."""
    if last is None or last.finish_reason == "length":
        return "limit"
    return "eos" if last.token_id is None else "word"


def stopping_word(text: str, full_text: str, stops: Sequence[str]) -> str:
    """The stop string that ended `text`: the first of `stops` right after it in the text the
    tokens decode to in full."""
    rest = full_text.removeprefix(text)
    return next((s for s in stops if s in rest), "")


def is_truncated(num_prompt: int, num_output: int, max_model_len: int) -> bool:
    """True when a sample's context filled up: generation stopped there, or (--context-shift)
    a shift dropped tokens to go on (as llama-server reports either)."""
    return num_prompt + num_output >= max_model_len
