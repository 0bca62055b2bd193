"""Disaggregated prefill between two GPUs of one host over NCCL (runs where two are visible,
e.g. the nvidia-h200-x2 device kind): a worker on cuda:0 killed in the middle of sending a
prompt's KV, the serving node on cuda:1 prefills it itself, answers with the tokens it gives
when no worker is there, and /metrics counts the fallback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from tests.children import ending_with_parent
from tests.disagg.test_disagg import DIES
from tests.server.conftest import _free_port, _wait_healthy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")

MODEL = ["--load-format", "dummy", "--model-config", "gemma3-270m", "--max-model-len", "4096"]
# NOTE: NVLink multicast (NVLS) off in every process NCCL runs in (the device machines' rule)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}


def test_a_worker_killed_mid_transfer_over_nccl(tmp_path: Path, worker_factory,
                                                monkeypatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # the worker's process inherits it
    worker = worker_factory(MODEL, DIES, flags=["--device", "cuda:0", "--backend", "nccl",
                                                "--log-level", "info"])
    port, log = _free_port(), tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(ending_with_parent(["-m", "muser", "serve", *MODEL, "--device",
                                 "cuda:1", "--port", str(port), "--prefill-worker",
                                 worker.address, "--disagg-backend", "nccl",
                                 "--disagg-min-tokens", "64", "--log-level", "info"]),
                                stdout=out, stderr=subprocess.STDOUT, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, 600)
        body = {"prompt": list(range(1000, 1600)), "n_predict": 8, "temperature": 0,
                "return_tokens": True}
        first = httpx.post(url + "/completion", timeout=300, json=body).json()
        worker.proc.wait(60)  # it died sending the KV
        metrics = httpx.get(url + "/metrics").text
        assert 'muser_disagg_requests_total{outcome="fallback_down"} 1.0' in metrics, metrics
        assert "fallback_down" in log.read_text()
        # with no worker left the prompt is prefilled here again: the tokens are those
        again = httpx.post(url + "/completion", timeout=300, json=body).json()
        assert first["tokens_predicted"] == 8 and first["tokens"] == again["tokens"]
    finally:
        proc.terminate()
        proc.wait(60)
