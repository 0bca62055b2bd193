"""The engine package: `Engine` (engine.py) drives one step as schedule -> run -> sample ->
emit over `Sequence`s (muser/sequence.py); its collaborators each own one concern:

    plan.py      StepPlan: a batch's rows, which sequences are due, where their logits are
    ahead.py     decode ahead: the next decode step queued before its tokens reach the host
    forks.py     n samples of one prompt, forked from its prefilled sequence
    echo.py      prompt logprobs
    speculation.py  speculative decoding: drafts per decoding sequence, their length, what
                 a verify pass accepts (proposer.py: the proposer seam; lookup.py: prompt
                 lookup, --speculative ngram; draft_model.py: a draft model, --speculative
                 draft)
    sampling.py  sampler rows of a step's due sequences
    emit.py      a sampled token -> its text, stops, finish
    source.py    admission sources (prefill elsewhere) that register with the engine
"""

from __future__ import annotations

from muser.engine.engine import Engine, SlotInfo

__all__ = ["Engine", "SlotInfo"]
