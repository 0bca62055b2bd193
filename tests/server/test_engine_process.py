"""The engine runs in a child process of `muser serve`: its death fails what is in flight with
a clear error and leaves the server answering; a killed server never leaves it behind."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

from tests.children import ending_with_parent
from tests.server.conftest import _free_port, _wait_healthy


def _engine_of(pid: int) -> int:
    """The pid of the server's engine process (its child running multiprocessing's spawn)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry))
    [engine] = found
    return engine


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _serve(gguf_path: Path, tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    port, log = _free_port(), tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(ending_with_parent(["-m", "muser", "serve", "--model",
                                 str(gguf_path), "--device", "cpu", "--port", str(port),
                                 "--max-num-seqs", "2", "--max-model-len", "512",
                                 "--log-level", "warning"]), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc, log, 300)
    return proc, url, log


def test_a_dead_engine_fails_requests_in_flight_and_the_server_says_so(
        gguf_path: Path, tmp_path: Path) -> None:
    proc, url, log = _serve(gguf_path, tmp_path)
    try:
        engine = _engine_of(proc.pid)
        result: dict = {}

        def long_request() -> None:
            result["r"] = httpx.post(url + "/completion", timeout=120, json={
                "prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True})

        client = threading.Thread(target=long_request)
        client.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                s["is_processing"] for s in httpx.get(url + "/slots").json()):
            time.sleep(0.05)
        os.kill(engine, signal.SIGKILL)
        client.join(60)
        r = result["r"]
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        health = httpx.get(url + "/health")
        assert health.status_code == 500
        assert health.json() == {"status": "error",
                                 "error": "the engine process exited with code -9"}
        refused = httpx.post(url + "/completion", json={"prompt": "Hi", "n_predict": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_dead"
        assert proc.poll() is None
        assert "the engine process exited with code -9; failing 1 requests" in log.read_text()
    finally:
        proc.terminate()
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises what it drained on


def test_a_killed_server_leaves_no_engine_behind(gguf_path: Path, tmp_path: Path) -> None:
    proc, _, _ = _serve(gguf_path, tmp_path)
    try:
        engine = _engine_of(proc.pid)
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(engine):
        time.sleep(0.1)
    gone = not _alive(engine)
    if not gone:
        os.kill(engine, signal.SIGKILL)
    assert gone
