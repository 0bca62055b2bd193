"""Token log-probabilities on the device, one small copy to the host.

Values are the log-softmax of the raw logits in float32, before any sampling transform
(penalties, top-k / top-p / min-p, temperature), as OpenAI and llama.cpp's n_probs report them.
A row asks for its chosen (or given) token's logprob and the k most likely tokens'; the whole
logit row never leaves the device: per row the host gets 2 + 2k numbers, packed with the token
ids into one float64 tensor (ids < 2**53 are exact there), one device->host copy for the batch.
"""

from __future__ import annotations

import torch

from muser.core import Logprobs


def pack(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """logits [B, vocab], token_ids [B] int64 (same device) -> [B, 2 + 2k] float64:
    token id, its logprob, the k best logprobs, their ids."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(1, token_ids[:, None])
    parts = [token_ids[:, None].double(), chosen.double()]
    if k:
        values, ids = torch.topk(logp, k)
        parts += [values.double(), ids.double()]
    return torch.cat(parts, 1)


def unpack(host: torch.Tensor, ks: list[int | None]) -> tuple[list[int], list[Logprobs | None]]:
    """pack's rows on the host, each row's k (None: the row did not ask) -> token ids,
    Logprobs."""
    width = (host.shape[1] - 2) // 2
    rows = host.tolist()
    tokens = [int(r[0]) for r in rows]
    out: list[Logprobs | None] = []
    for r, k in zip(rows, ks):
        if k is None:
            out.append(None)
            continue
        top = tuple((int(i), v) for v, i in zip(r[2:2 + k], r[2 + width:2 + width + k]))
        out.append(Logprobs(r[1], top))
    return tokens, out


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[Logprobs]:
    """logits [R, vocab] on the device, the R tokens whose logprob is wanted -> one Logprobs
    per row (the k best each), with one device->host copy."""
    ids = torch.tensor(token_ids, dtype=torch.int64).to(logits.device, non_blocking=True)
    return unpack(pack(logits, ids, k).cpu(), [k] * len(token_ids))[1]
