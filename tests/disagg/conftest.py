"""Prefill workers as real processes on loopback (`muser prefill-worker`), optionally with one
function of muser.disagg.worker replaced to inject a fault."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.children import ending_with_parent
from tests.server.conftest import _free_port

WORKER_FLAGS = ["--device", "cpu", "--max-model-len", "2048", "--log-level", "info"]


class Worker:
    def __init__(self, proc: subprocess.Popen, address: str, log: Path) -> None:
        self.proc, self.address, self.log = proc, address, log

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def start_worker(tmp: Path, model_args: list[str], patch: str = "", port: int | None = None,
                 flags: list[str] = WORKER_FLAGS) -> Worker:
    """A prefill worker on a free port; `patch`: Python run first (e.g. replacing a function
    of muser.disagg.worker) to make it misbehave; `flags`: its device and the rest. Waits until
    it is ready."""
    port = port or _free_port()
    address = f"127.0.0.1:{port}"
    log = tmp / f"worker_{port}_{time.monotonic_ns()}.log"
    code = (f"{patch}\nfrom muser.cli import main\nraise SystemExit(main({['prefill-worker', '--listen', address, *model_args, *flags]!r}))")
    with log.open("w") as out:
        proc = subprocess.Popen(ending_with_parent(["-c", code]), stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ,
                                                               "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while "prefill worker ready" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return Worker(proc, address, log)


@pytest.fixture
def worker_factory(tmp_path: Path):
    started: list[Worker] = []

    def make(model_args: list[str], patch: str = "", port: int | None = None,
             flags: list[str] = WORKER_FLAGS) -> Worker:
        w = start_worker(tmp_path, model_args, patch, port, flags)
        started.append(w)
        return w

    yield make
    for w in started:
        w.stop()
