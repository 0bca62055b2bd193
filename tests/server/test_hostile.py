"""What a web page or a broken client can do to a keyless server on loopback: cross-origin
simple requests (text/plain) run nothing, slot actions need a key, a body cut off mid-request
leaves one log line and nothing behind."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.server.conftest import Server, start_server, stop_server

EVIL = {"Origin": "http://evil.example", "Content-Type": "text/plain;charset=UTF-8"}


@pytest.fixture(scope="module")
def keyless(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("keyless")
    s = start_server(gguf_path, tmp, ["--max-num-seqs", "2", "--max-model-len", "256",
                                      "--slot-save-path", str(tmp / "files"),
                                      "--log-level", "info"])
    s.folder = tmp / "files"
    try:
        yield s
    finally:
        stop_server(s.proc)


def test_cross_origin_simple_requests_run_nothing(keyless: Server) -> None:
    c = keyless.client(key=None)
    steps = keyless.metric("muser_steps_total")
    for path, body in [("/completion", '{"prompt": "x", "n_predict": 8}'),
                       ("/v1/completions", '{"prompt": "x", "max_tokens": 8}'),
                       ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}]}'),
                       ("/tokenize", '{"content": "x"}')]:
        for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x", None):
            headers = {**EVIL, "Content-Type": ctype} if ctype else {"Origin": EVIL["Origin"]}
            r = c.post(path, content=body, headers=headers)
            assert r.status_code == 415, (path, ctype, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
    assert keyless.metric("muser_steps_total") == steps
    r = c.post("/completion", content='{"prompt": "x", "n_predict": 2}',
               headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_slot_actions_need_a_key_or_the_opt_in(keyless: Server) -> None:
    c = keyless.client(key=None)
    c.post("/completion", json={"prompt": "Hello there", "n_predict": 2})
    for action in ("save", "restore", "erase"):
        for headers in (EVIL, {"Content-Type": "application/json"}):
            r = c.post(f"/slots/0?action={action}", content='{"filename": "x.bin"}',
                       headers=headers)
            assert r.status_code == 403, r.text
            assert "--admin-key" in r.json()["error"]["message"]
    assert list(keyless.folder.iterdir()) == []
    assert c.get("/slots").status_code == 200


def _raw(server: Server, data: bytes, then_close: bool = True) -> bytes:
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(data)
        if then_close:
            return b""
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_bodies_cut_off_log_one_line_and_leave_nothing(keyless: Server) -> None:
    head = (b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    before = keyless.log.read_text()
    _raw(keyless, head + b"Content-Length: 400\r\n\r\n" + b'{"prompt": "x", ')
    _raw(keyless, head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n" + b'{"pro' + b"\r\nzz\r\n",
         then_close=False)
    _raw(keyless, head + b"Transfer-Encoding: chunked\r\n\r\n40\r\n" + b'{"prompt"')
    short = b'{"prompt": "x", "n_predict": 2}'
    _raw(keyless, head + b"Content-Length: 5\r\n\r\n" + short, then_close=False)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and keyless.log.read_text().count("went away") < 2:
        time.sleep(0.1)
    log = keyless.log.read_text()[len(before):]
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    assert log.count("the client went away") >= 2, log
    assert keyless.metric("muser_live_requests") == 0
    assert keyless.client(key=None).get("/health").json() == {"status": "ok"}
