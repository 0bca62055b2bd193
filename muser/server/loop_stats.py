"""LoopStats: what the engine loop reports after each step (torch-free: the server reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from muser.core import SlotInfo, SpecStats
from muser.kvcache.prefix import PrefixStats
from muser.memory import MemoryReport
from muser.scheduler import STEP_KINDS


@dataclass(frozen=True, slots=True)
class LoopStats:
    """A consistent snapshot taken by the loop thread after every step."""

    queue_depth: dict[str, int] = field(default_factory=lambda: {"decode": 0, "prefill": 0})
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    rows: dict[str, int] = field(default_factory=lambda: {"decode": 0, "prefill": 0})
    slots: tuple[SlotInfo, ...] = ()
    num_free_seqs: int = 0
    num_free_pages: int = 0
    memory: MemoryReport | None = None  # fixed at startup (the runner's); None before
    preemptions: int = 0
    prefix: PrefixStats | None = None  # None: --no-prefix-cache
    disagg: dict | None = None  # the prefill workers' outcomes and transfers, when any
    speculation: SpecStats | None = None  # None: no --speculative
    # per slot: the tokens its last sequence left in the prefix cache (its cache in
    # llama-server's sense), and the requests waiting for it (pinned to it by id_slot)
    slot_cache: dict[int, int] = field(default_factory=dict)
    slot_waiting: dict[int, int] = field(default_factory=dict)
