"""SIGTERM drains in-flight requests, then exits. Runs last: it stops the shared server."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from tests.server.conftest import ADMIN_KEY, API_KEY, FILE_KEYS, Server


def test_sigterm_drains_the_stream_in_flight_then_exits(server: Server) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 12, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with server.client().stream("POST", "/completion", json=body) as r:
        events = r.iter_lines()
        first = next(e for e in events if e.startswith("data: "))
        server.proc.send_signal(signal.SIGTERM)
        rest = [e for e in events if e.startswith("data: ")]
    chunks = [json.loads(e[6:]) for e in [first, *rest]]
    assert chunks[-1]["stop"] is True and chunks[-1]["tokens_predicted"] == 12
    # NOTE: uvicorn re-raises the signal once it has drained, so -SIGTERM is a clean exit.
    assert server.proc.wait(60) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
    log = server.log.read_text()
    assert not any(key in log for key in (API_KEY, ADMIN_KEY, *FILE_KEYS))
