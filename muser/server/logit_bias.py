"""logit_bias, in llama-server's forms and OpenAI's, as (token id, bias) pairs.

    OpenAI (/v1/*)      {"<token id>": bias}, bias in [-100, 100]
    llama-server        [[token id or text, bias or false], ...] or {"<token id or text>": bias
                        or false}; a text stands for each of its tokens (encoded without BOS),
                        false for -inf (the token is never chosen)

The sampler adds each bias to its token's logit before anything else (muser/sampler.py);
several entries for one token add up. Anything else is a 400 naming logit_bias.
"""

from __future__ import annotations

import math
from typing import Any

from muser.server.errors import ApiError
from muser.tokenizer import Tokenizer

MAX_ENTRIES = 4096


def resolve(tokenizer: Tokenizer, raw: list | dict | None,
            openai: bool) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif openai:
        raise _bad("an object of token ids to biases")
    else:
        if not all(isinstance(p, list) and len(p) == 2 for p in raw):
            raise _bad("[token or text, bias] pairs")
        pairs = [tuple(p) for p in raw]
    if len(pairs) > MAX_ENTRIES:
        raise _bad(f"at most {MAX_ENTRIES} entries")
    biases: dict[int, float] = {}
    for key, value in pairs:
        bias = _bias(value, openai)
        for token in _tokens(tokenizer, key, openai):
            biases[token] = biases.get(token, 0.0) + bias
    return tuple(biases.items())


def _bias(value: Any, openai: bool) -> float:
    if value is False and not openai:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad("a bias must be a number" + ("" if openai else " or false"))
    if openai and not -100 <= value <= 100:
        raise _bad("a bias must be in [-100, 100]")
    return float(value)


def _tokens(tokenizer: Tokenizer, key: Any, openai: bool) -> list[int]:
    if isinstance(key, str):
        digits = key.strip()
        if digits.lstrip("-").isdigit():
            key = int(digits)
        elif openai:
            raise _bad(f"{key!r} is not a token id")
        else:
            return tokenizer.encode(key, False)
    if isinstance(key, bool) or not isinstance(key, int):
        raise _bad("a key must be a token id" + ("" if openai else " or a text"))
    if not 0 <= key < tokenizer.vocab_size:
        raise _bad(f"token id {key} out of range [0, {tokenizer.vocab_size})")
    return [key]


def _bad(why: str) -> ApiError:
    return ApiError(400, f"logit_bias: {why}", "invalid_value", "logit_bias")
