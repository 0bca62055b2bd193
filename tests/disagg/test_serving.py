"""`muser serve --prefill-worker`: while a long prompt is prefilled remotely, other streams
keep decoding; /slots and /metrics show the remote request; leaving cancels it."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import httpx

from tests.children import ending_with_parent
from tests.disagg.test_disagg import SLOW
from tests.server.conftest import _free_port, _wait_healthy


def test_streams_decode_while_a_prompt_is_prefilled_remotely(gguf_path: Path, tmp_path: Path,
                                                             worker_factory) -> None:
    worker = worker_factory(["--model", str(gguf_path)], SLOW)  # 8 s per prefill
    port, log = _free_port(), tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(ending_with_parent(["-m", "muser", "serve", "--model",
                                 str(gguf_path), "--device", "cpu", "--port", str(port),
                                 "--max-model-len", "2048", "--prefill-worker", worker.address,
                                 "--disagg-min-tokens", "200", "--log-level", "info"]),
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, 300)
        long_prompt = list(range(1000, 1300))
        gone = threading.Event()

        def remote_then_leave() -> None:
            try:
                httpx.post(url + "/completion", timeout=3, json={
                    "prompt": long_prompt, "n_predict": 4})
            except httpx.ReadTimeout:
                gone.set()

        leaver = threading.Thread(target=remote_then_leave)
        leaver.start()
        deadline = time.monotonic() + 2
        slots = []
        while time.monotonic() < deadline and not any(
                s["state"] == "remote" for s in slots):
            slots = httpx.get(url + "/slots").json()
        assert any(s["state"] == "remote" and s["n_prompt_tokens"] == 300 for s in slots), slots
        start = time.monotonic()
        short = httpx.post(url + "/completion", timeout=60, json={
            "prompt": "Once upon a time", "n_predict": 8, "ignore_eos": True}).json()
        assert short["tokens_predicted"] == 8
        assert time.monotonic() - start < 8  # NOTE: it did not wait for the remote prefill
        leaver.join()
        assert gone.is_set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
                s["is_processing"] for s in httpx.get(url + "/slots").json()):
            time.sleep(0.2)
        assert not any(s["is_processing"] for s in httpx.get(url + "/slots").json())
        metrics = httpx.get(url + "/metrics").text
        assert 'muser_disagg_requests_total{outcome="local_short"} 1.0' in metrics
        assert "muser_disagg_transfer_seconds_bucket" in metrics
        assert f'muser_disagg_worker_up{{worker="{worker.address}"}}' in metrics
    finally:
        proc.terminate()
        proc.wait(60)
