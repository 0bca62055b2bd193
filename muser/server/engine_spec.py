"""What the server hands the engine process (EngineSpec) and what it answers once loaded
(Ready); torch-free, both sides import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from muser.constraint import GrammarLimits
from muser.memory import MemoryReport
from muser.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build the engine: LLM(model, **llm_kwargs)."""

    model: str | None
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    log_level: str = "info"
    progress: bool = False
    disagg: dict[str, Any] | None = None  # muser.disagg.client.attach's keywords
    slot_save_path: str | None = None  # where slot files live (None: no save / restore)
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)  # a grammar's cost


@dataclass(frozen=True)
class Ready:
    tokenizer: Tokenizer
    model_path: str
    max_model_len: int
    max_num_seqs: int
    memory: MemoryReport | None
    batching: dict[str, Any]  # the step limits the engine runs with (GPU: how one was measured)
    hidden_size: int  # the model's: an embedding's dimensions
