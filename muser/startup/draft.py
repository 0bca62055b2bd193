"""The draft model's runner (`--speculative draft`): a model loaded beside the target, checked
against it, started as a runner of its own in the same process.

Each check refuses the pair with a ConfigError that names what differs:
- the tokenizers (Tokenizer.difference): every id the draft can propose is the same token in
  the target's vocabulary, special where it is special there, with the same BOS, EOS and
  end-of-turn ids;
- the draft's embedding rows: no more than the target's (each id it proposes is a row the
  target's embedding holds);
- the draft's context: at least the target's max_model_len (it drafts at every position).

Its EngineConfig is the target's (sequence slots, page size, speculative settings: its rings
hold window + K rows too) with the prefix cache off: the draft's rows of drafts that did not
hold are truncated (Runner.truncate), which checkpoints could not follow.
"""

from __future__ import annotations

import dataclasses

from muser.errors import ConfigError
from muser.loading import LoadedModel
from muser.runner import Runner
from muser.startup.log import StartupLog
from muser.startup.start import start
from muser.tokenizer import Tokenizer


def start_draft(target: Runner, tokenizer: Tokenizer, draft: LoadedModel,
                log: StartupLog) -> Runner:
    """The draft model's runner, ready, once `draft` passed its checks against `target` and
    its `tokenizer`; raises ConfigError naming the first difference."""
    check_draft(target, tokenizer, draft)
    engine = dataclasses.replace(target.engine, prefix_cache=False, kv_host_gb=0.0)
    emit = log.emit
    # NOTE: its lines (memory, CPU kernels) say whose they are
    named = StartupLog(None if emit is None else (
        lambda line: emit(line.replace("startup: ", "startup: draft model's ", 1))))
    return start(draft.config, engine, draft.weights, named)


def check_draft(target: Runner, tokenizer: Tokenizer, draft: LoadedModel) -> None:
    """Raise ConfigError unless `draft` can draft for `target` (the module's checks)."""
    name = f"--speculative-model {draft.path}"
    difference = tokenizer.difference(draft.tokenizer)
    if difference is not None:
        raise ConfigError(f"{name}: its tokenizer is not the target's ({difference}); a draft "
                          f"model must share the target's vocabulary")
    rows, target_rows = draft.config.vocab_size, target.cfg.vocab_size
    if rows > target_rows:
        raise ConfigError(f"{name}: its embedding has {rows} rows, the target's {target_rows}: "
                          f"ids from {target_rows} on are not the target's")
    context, limit = draft.config.max_position_embeddings, target.engine.max_model_len
    if context < limit:
        raise ConfigError(f"{name}: its context is {context} positions, shorter than the "
                          f"target's max_model_len {limit} (--max-model-len {context} fits both)")
