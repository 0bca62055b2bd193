"""Startup: everything between loaded weights and a runner ready to serve, in one place.

    log.py ............ StartupLog: each phase reported with its duration as it ends
    start.py .......... start(): the runner built, then driven through the phases below, in
                        order; the result is one immutable StartupRecord (muser/startup_record.py,
                        outside the package: the runner holds it and never imports this one)
    warmup.py ......... the picks, compile, tune and capture phases (a GPU's warm-up)
    shapes.py ......... the shapes the warm-up runs
    memory.py ......... the warm-up's peak and graph pool, the KV pages sized from the memory
                        left, the memory report
    waiting_chunk.py .. the prefill-row cap while sequences decode, measured

This package imports torch only in its modules that drive the runner: `StartupLog` and
`StartupRecord` import from here without it.
"""

from __future__ import annotations

from muser.startup.log import StartupLog
from muser.startup_record import StartupRecord

__all__ = ["StartupLog", "StartupRecord"]
