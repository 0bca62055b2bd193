"""--sleep-idle-seconds over HTTP: the engine process stops after the idle time (read-only
routes still answer and do not wake it) and the next request that needs it starts a fresh one,
which answers as the first did."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.server.conftest import Server, start_server, stop_server


@pytest.fixture(scope="module")
def sleepy(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("sleep")
    s = start_server(gguf_path, tmp, ["--max-num-seqs", "2", "--max-model-len", "256",
                                      "--sleep-idle-seconds", "1"])
    try:
        yield s
    finally:
        stop_server(s.proc)


def _children(pid: int) -> list[str]:
    """The ids of a process's child processes (Linux's /proc)."""
    return [c for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def _wait_asleep(s: Server, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not s.client(None).get("/props").json()["is_sleeping"]:
        assert time.monotonic() < deadline, "the engine did not go to sleep"
        time.sleep(0.2)


def test_the_engine_sleeps_when_idle_and_wakes_on_a_request(sleepy: Server) -> None:
    c = sleepy.client(None)
    body = {"prompt": "The garden was", "n_predict": 6, "temperature": 0}
    before = c.post("/completion", json=body).json()
    awake = set(_children(sleepy.proc.pid))
    _wait_asleep(sleepy)
    deadline = time.monotonic() + 60
    while not awake - set(_children(sleepy.proc.pid)):  # NOTE: the engine process exits
        assert time.monotonic() < deadline, "the engine process did not stop"
        time.sleep(0.2)
    asleep = set(_children(sleepy.proc.pid))
    assert len(awake - asleep) == 1 and asleep <= awake
    for path in ("/health", "/v1/models", "/metrics", "/slots"):
        assert c.get(path).status_code == 200, path
    assert c.get("/props").json()["is_sleeping"] is True
    after = c.post("/completion", json=body).json()
    assert after["content"] == before["content"] and after["tokens_predicted"] == 6
    assert c.get("/props").json()["is_sleeping"] is False
    assert len(set(_children(sleepy.proc.pid)) - asleep) == 1
    _wait_asleep(sleepy)
    assert c.post("/tokenize", json={"content": "Hi"}).status_code == 200
    assert c.get("/props").json()["is_sleeping"] is False
