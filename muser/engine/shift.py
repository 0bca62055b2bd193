"""Context shift (EngineConfig.context_shift, llama-server's --context-shift): a sequence whose
context is full drops the oldest half of its rows after the first n_keep and goes on.

    before  [ kept: num_kept ][ dropped: n_discard ][ rest ........ ] + the token just sampled
    after   [ kept ][ rest ........ ] + the token          (at positions 0, 1, ... again)

llama-server moves the kept keys to their new positions in place (a RoPE shift of its cache)
and keeps their values, which had attended to the rows now dropped. Here the sequence's KV is
dropped and what it keeps is prefilled again from position 0, in the steps the scheduler gives
it (its slot kept; leading rows the prefix cache still holds are reused, which gives the same
bits): after a shift the sequence is, bit for bit, what a new request with the shortened
context as its prompt would be, at the cost of one prefill of about half the context per shift.
The sliding layers' rings bound their memory to the window anyway; what a shift bounds is the
full-attention layers' pages and the positions they see, at max_model_len.

    kept      n_keep prompt tokens after BOS (SamplingParams.n_keep; -1: the whole prompt),
              BOS included, at most max_model_len - 4
    dropped   SamplingParams.n_discard rows after them (0: half of the rest), at most all of
              the rest but one
"""

from __future__ import annotations

from muser.core import Status
from muser.runner import Runner
from muser.sequence import Sequence


def split(seq: Sequence, bos_id: int | None, max_model_len: int) -> tuple[int, int]:
    """`seq`'s context is full -> (rows kept at its start, rows dropped after them)."""
    p = seq.sampling
    keep = seq.num_prompt if p.n_keep < 0 else p.n_keep
    if seq.prompt_ids[0] == bos_id:
        keep += 1
    keep = min(keep, max_model_len - 4)
    rest = seq.num_cached - keep
    return keep, max(0, min(p.n_discard or rest // 2, rest - 1))


def shift(runner: Runner, seq: Sequence, bos_id: int | None, max_model_len: int) -> None:
    """Drop `seq`'s rows as `split` says and its KV with them; it goes back to prefilling what
    it keeps (Sequence.context_ids), in the slot it had."""
    keep, dropped = split(seq, bos_id, max_model_len)
    seq.num_kept, seq.num_shifted = keep, seq.num_shifted + dropped
    slot = seq.slot
    runner.free(seq)
    runner.allocate(seq.context_ids, count=False, seq=seq, slot=slot)
    seq.drafts, seq.status = [], Status.PREFILL
