"""One real `muser serve` process on a free loopback port, shared by the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.children import ending_with_parent

API_KEY, FILE_KEYS, ADMIN_KEY = "test-key", ("file-key-1", "file-key-2"), "admin-key"
MAX_NUM_SEQS, MAX_QUEUE, MAX_MODEL_LEN, MAX_BODY = 4, 4, 1024, 65536


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    model: str
    log: Path

    def client(self, key: str | None = API_KEY, timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def admin(self) -> httpx.Client:
        return self.client(ADMIN_KEY)

    def metric(self, name: str) -> float:
        """Sum of every sample of a metric (all label sets)."""
        text = self.client().get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith((name + "{", name + " ")))

    def busy_slots(self) -> list[dict]:
        return [s for s in self.admin().get("/slots").json() if s["is_processing"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not healthy after {timeout_s}s:\n{log.read_text()[-3000:]}")


def start_server(gguf_path: Path, tmp: Path, args: list[str]) -> Server:
    """`muser serve` on a free loopback port with `args`, once /health answers 200."""
    port = _free_port()
    log = tmp / "server.log"
    cmd = ["-m", "muser", "serve", "--model", str(gguf_path), "--device", "cpu",
           "--port", str(port), "--log-level", "warning", *args]
    with log.open("w") as out:
        proc = subprocess.Popen(ending_with_parent(cmd), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, 300)
    except BaseException:
        stop_server(proc)
        raise
    return Server(url, proc, gguf_path.stem, log)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="session")
def server(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("server")
    key_file = tmp / "keys.txt"
    key_file.write_text("# keys\n" + "\n".join(FILE_KEYS) + "\n\n")
    s = start_server(gguf_path, tmp, [
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue", str(MAX_QUEUE), "--max-model-len",
        str(MAX_MODEL_LEN), "--max-body-bytes", str(MAX_BODY), "--api-key", API_KEY,
        "--api-key-file", str(key_file), "--admin-key", ADMIN_KEY, "--drain-timeout", "60",
        "--strict-model-name"])
    try:
        yield s
    finally:
        stop_server(s.proc)
