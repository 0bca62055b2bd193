"""Token logprobs in each dialect's response shape: OpenAI's completions and chat, llama.cpp's
n_probs (completion_probabilities).

The values are the engine's (muser/logprobs.py): log-softmax of the raw logits, before any
sampling transform (with llama-server's post_sampling_probs, the logs of the distribution the
token was drawn from, muser/sampler.py, shown as probabilities). A token's text is its piece decoded as UTF-8 (a piece that is part of a
character decodes to U+FFFD; `bytes` has the raw bytes)."""

from __future__ import annotations

import math
from typing import Any

from muser.core import Logprobs
from muser.tokenizer import Tokenizer

Entry = tuple[int, Logprobs | None]  # a token id and its logprobs (None: the first prompt token)


class Pieces:
    """Token id -> (text, bytes), cached per response."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._seen:
            raw = self.tokenizer.token_to_piece(token_id)
            self._seen[token_id] = (raw.decode("utf-8", "replace"), list(raw))
        return self._seen[token_id]


def completion(pieces: Pieces, entries: list[Entry], offset: int = 0) -> dict[str, Any]:
    """OpenAI's /v1/completions `logprobs` object: tokens, token_logprobs, top_logprobs (the k
    best and the chosen token, by text), text_offset (characters from `offset`)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in entries:
        text = pieces(token_id)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(lp.logprob)
        top = {pieces(i)[0]: v for i, v in lp.top}
        top.setdefault(text, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat(pieces: Pieces, entries: list[Entry]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object: content [{token, logprob, bytes, top_logprobs}]."""
    def one(token_id: int, value: float) -> dict[str, Any]:
        text, raw = pieces(token_id)
        return {"token": text, "logprob": value, "bytes": raw}

    return {"content": [{**one(t, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]}
                        for t, lp in entries if lp is not None], "refusal": None}


def llama(pieces: Pieces, entries: list[Entry], post_sampling: bool = False
          ) -> list[dict[str, Any]]:
    """llama.cpp's completion_probabilities: [{id, token, logprob, bytes, top_logprobs}];
    post_sampling (the engine's values are then logs of the post-sampling distribution):
    [{id, token, prob, bytes, top_probs}] without the tokens of probability 0, as llama-server
    lists them."""
    value, top = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def one(token_id: int, v: float) -> dict[str, Any]:
        text, raw = pieces(token_id)
        return {"id": token_id, "token": text, value: math.exp(v) if post_sampling else v,
                "bytes": raw}

    return [{**one(t, lp.logprob), top: [one(i, v) for i, v in lp.top
                                         if not post_sampling or v > -math.inf]}
            for t, lp in entries if lp is not None]
