"""Ready means ready: a server that is still loading binds its port at once and answers
/health 503 {"status": "loading"}, and generation routes 503 with Retry-After, until the engine
is loaded and warmed up; then 200. A startup that fails stops the server with one error line."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.children import ending_with_parent
from tests.server.conftest import _free_port


def _serve(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(ending_with_parent(["-m", "muser", "serve", "--device", "cpu",
                                 "--log-level", "info", *args]), stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_loading_answers_503_until_ready(gguf_path: Path, tmp_path: Path) -> None:
    port, log = _free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = _serve(["--model", str(gguf_path), "--port", str(port), "--max-num-seqs", "2",
                   "--max-model-len", "256"], log)
    seen, refused = [], None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(url + "/health", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.02)
                continue
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            if refused is None:
                refused = httpx.post(url + "/completion", json={"prompt": "Hi", "n_predict": 2},
                                     timeout=5)
        assert seen and seen[-1] == (200, {"status": "ok"}), log.read_text()[-2000:]
        assert (503, {"status": "loading"}) in seen
        assert all(s == (503, {"status": "loading"}) for s in seen[:-1])
        assert refused is not None and refused.status_code == 503
        assert refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "loading"
        ok = httpx.post(url + "/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=60)
        assert ok.status_code == 200 and ok.json()["tokens_predicted"] == 2
        text = log.read_text()
        assert "startup: weights" in text and "startup: ready in" in text
    finally:
        proc.terminate()
        proc.wait(60)


def test_failed_startup_exits_with_one_error_line(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = _serve(["--model", str(tmp_path / "missing.gguf"), "--port", str(_free_port())], log)
    assert proc.wait(120) == 2
    assert "muser: error:" in log.read_text()
