"""The one-time build of the CPU kernels: each source compiled by its own compiler process, as
many at once as the machine has cores, then one link into muser's cache. What it does is
reported line by line (each source as it ends, and a line every HEARTBEAT_S seconds while one
still runs), so a first start never waits in silence.

Before it compiles anything it checks that the compiler exists and can build an OpenMP shared
library, and says what to install when not."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from muser.errors import MuserError

HEARTBEAT_S = 5.0  # the longest a build runs without a line
INSTALL = "install a C compiler with OpenMP (Debian/Ubuntu: apt-get install gcc; " \
          "Fedora: dnf install gcc; macOS: brew install gcc) or set CC to one"
PROBE = "#include <omp.h>\nint muser_probe(void) { return omp_get_max_threads(); }\n"


class NativeUnavailable(MuserError):
    """The C kernels could not be built or loaded on this machine."""


def check_compiler(cc: str, flags: list[str], work: Path) -> None:
    """Raise NativeUnavailable naming what to install unless `cc` builds an OpenMP library."""
    if shutil.which(cc) is None:
        raise NativeUnavailable(f"no C compiler '{cc}' (from CC, else cc) on PATH: {INSTALL}")
    probe = work / "probe.c"
    probe.write_text(PROBE)
    proc = subprocess.run([cc, *flags, "-o", str(work / "probe.so"), str(probe)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NativeUnavailable(
            f"the C compiler '{cc}' cannot build an OpenMP library (-fopenmp, omp.h, libgomp "
            f"or libomp): {INSTALL}; for clang also its OpenMP runtime (apt-get install "
            f"libomp-dev)\n{proc.stderr.strip()}")


def build(cc: str, flags: list[str], sources: list[Path], target: Path,
          report: Callable[[str], None], jobs: int | None = None,
          heartbeat: float = HEARTBEAT_S) -> None:
    """Compile `sources` (at most `jobs` at once: the cores) and link them into `target`,
    reporting each source as it ends, and what still runs every `heartbeat` seconds without
    a line, to `report`. The library appears whole or not at all."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(sources)))
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        check_compiler(cc, flags, work)
        report(f"compiling {len(sources)} sources, {jobs} at a time")
        objects = _compile_all(cc, flags, sources, work, jobs, report, heartbeat)
        out = work / target.name
        _run(cc, [*flags, "-o", str(out), *map(str, objects), "-lm"], "linking")
        os.replace(out, target)  # NOTE: atomic: concurrent builders agree on the result
    report(f"built {target.name} in {time.perf_counter() - start:.1f} s")


def _compile_all(cc: str, flags: list[str], sources: list[Path], work: Path, jobs: int,
                 report: Callable[[str], None], heartbeat: float) -> list[Path]:
    """One `cc -c` a source, `jobs` at a time, longest first (gemm.c) -> the objects."""
    objects = [work / f"{src.stem}.o" for src in sources]
    pending = sorted(zip(sources, objects), key=lambda so: -so[0].stat().st_size)
    running: dict[subprocess.Popen, tuple[Path, float]] = {}
    last_line = time.perf_counter()
    try:
        while pending or running:
            while pending and len(running) < jobs:
                src, obj = pending.pop(0)
                proc = subprocess.Popen([cc, *flags, "-c", str(src), "-o", str(obj)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
                running[proc] = src, time.perf_counter()
            time.sleep(0.05)
            now = time.perf_counter()
            for proc in [p for p in running if p.poll() is not None]:
                src, began = running.pop(proc)
                _, stderr = proc.communicate()
                if proc.returncode != 0:
                    raise NativeUnavailable(f"compiling {src.name} with {cc} failed:\n"
                                            f"{stderr.strip()}")
                report(f"compiled {src.name} in {now - began:.1f} s")
                last_line = now
            if running and now - last_line >= heartbeat:
                names = ", ".join(f"{src.name} {now - began:.0f} s"
                                  for src, began in running.values())
                report(f"still compiling {names}")
                last_line = now
    finally:
        for proc in running:  # NOTE: a failed source stops the others
            proc.kill()
            proc.communicate()
    return objects


def _run(cc: str, args: list[str], what: str) -> None:
    proc = subprocess.run([cc, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NativeUnavailable(f"{what} the CPU kernels with {cc} failed:\n"
                                f"{proc.stderr.strip()}")
