"""StartupRecord: what getting a runner ready did and measured, made once by the startup
(muser/startup/start.py) and read, never changed, by the runner, the engine and `LLM`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from muser.memory import MemoryReport


@dataclass(frozen=True, slots=True)
class StartupRecord:
    # phase name -> what it reported (StartupLog.details: "picks", "compile", "tune",
    # "capture", "chunk cap", and the phases logged before the runner's); empty on the CPU
    phases: Mapping[str, Mapping]
    # the prefill rows per step while any decodes: the one given, else the one measured
    # (muser/startup/waiting_chunk.py; None: neither, the scheduler's default applies)
    waiting_chunk: int | None
    memory: MemoryReport  # what each category holds, the KV pages' number among it

    @property
    def num_pages(self) -> int:
        return self.memory.num_pages
