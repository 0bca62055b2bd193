"""StartupLog: the phases of getting ready (weights, compile, tune, capture), each reported with
its duration as it ends, and the total once the engine is ready."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StartupLog:
    emit: Callable[[str], None] | None = None  # one line per phase; None: silent
    phases: dict[str, float] = field(default_factory=dict)  # name -> seconds
    details: dict[str, dict] = field(default_factory=dict)  # name -> what the phase reported
    started: float = field(default_factory=time.perf_counter)

    @contextmanager
    def phase(self, name: str) -> Iterator[dict]:
        """Time a phase; what the body puts in the yielded dict is reported beside it."""
        if self.emit:
            self.emit(f"startup: {name} ...")
        detail: dict = {}
        start = time.perf_counter()
        yield detail
        self.phases[name] = round(time.perf_counter() - start, 3)
        self.details[name] = detail
        if self.emit:
            extra = ", ".join(f"{k} {v}" for k, v in detail.items())
            self.emit(f"startup: {name} {self.phases[name]:.1f} s" + (f" ({extra})" if extra
                                                                      else ""))

    def note(self, line: str) -> None:
        """Report one line that is not a phase (e.g. what memory holds)."""
        if self.emit:
            self.emit(f"startup: {line}")

    def ready(self) -> float:
        """Report the total since the log was made -> seconds."""
        total = round(time.perf_counter() - self.started, 3)
        if self.emit:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in self.phases.items())
            self.emit(f"startup: ready in {total:.1f} s ({parts})")
        return total
