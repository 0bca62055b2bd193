"""POST /slots/{id}?action=save|restore|erase over HTTP: llama-server's answers, the admin key,
file names confined to --slot-save-path, and a restored prefix reused by the next prompt with
the tokens a cold prefill gives."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tests.server.conftest import ADMIN_KEY, API_KEY, Server, start_server, stop_server


@pytest.fixture(scope="module")
def slot_server(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("slots")
    s = start_server(gguf_path, tmp, [
        "--max-num-seqs", "1", "--max-model-len", "512", "--api-key", API_KEY,
        "--admin-key", ADMIN_KEY, "--slot-save-path", str(tmp / "files")])
    s.folder = tmp / "files"
    try:
        yield s
    finally:
        stop_server(s.proc)


def _ids(s: Server, text: str, special: bool) -> list[int]:
    return s.client().post("/tokenize", json={"content": text, "add_special": special}).json()[
        "tokens"]


def test_save_erase_restore_and_reuse(slot_server: Server) -> None:
    c, admin, folder = slot_server.client(), slot_server.admin(), slot_server.folder
    prompt = _ids(slot_server, "The tide came in over the stones. " * 8, True)
    body = {"n_predict": 4, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    first = c.post("/completion", json={**body, "prompt": prompt}).json()
    ids = prompt + first["tokens"][:-1]  # NOTE: the last token was never fed back

    r = admin.post("/slots/0?action=save", json={"filename": "turn.bin"})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert set(saved) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert saved["id_slot"] == 0 and saved["filename"] == "turn.bin"
    assert saved["n_saved"] == len(ids) and saved["timings"]["save_ms"] > 0
    assert saved["n_written"] == (folder / "turn.bin").stat().st_size
    assert admin.post("/slots/0?action=erase").json() == {"id_slot": 0, "n_erased": len(ids)}

    follow = {**body, "prompt": ids + _ids(slot_server, " Then the keeper wrote it down.", False)}
    cold = c.post("/completion", json=follow).json()
    assert cold["timings"]["cache_n"] == 0
    admin.post("/slots/0?action=erase")  # NOTE: forget what the cold run cached
    r = admin.post("/slots/0?action=restore", json={"filename": "turn.bin"})
    assert r.status_code == 200, r.text
    restored = r.json()
    assert set(restored) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert restored["n_restored"] == len(ids) and restored["n_read"] == saved["n_written"]
    warm = c.post("/completion", json=follow).json()
    assert warm["timings"]["cache_n"] == len(ids)
    assert warm["timings"]["prompt_n"] == len(follow["prompt"]) - len(ids)
    assert warm["tokens"] == cold["tokens"] and warm["content"] == cold["content"]


def _other_model_file(src: Path, dst: Path) -> None:
    """`src` with another fingerprint in its metadata (same length, offsets kept)."""
    data = bytearray(src.read_bytes())
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + size])
    header["__metadata__"]["fingerprint"] = "f" * len(header["__metadata__"]["fingerprint"])
    new = json.dumps(header, separators=(",", ":")).encode()
    data[8:8 + size] = new + b" " * (size - len(new))
    dst.write_bytes(bytes(data))


def test_refusals(slot_server: Server, server: Server) -> None:
    c, admin, folder = slot_server.client(), slot_server.admin(), slot_server.folder
    c.post("/completion", json={"prompt": "Hello there", "n_predict": 2, "temperature": 0})
    assert admin.post("/slots/0?action=save", json={"filename": "mine.bin"}).status_code == 200
    _other_model_file(folder / "mine.bin", folder / "other.bin")
    os.symlink(folder / "mine.bin", folder / "link.bin")
    os.symlink("/etc/hostname", folder / "out.bin")
    cases = [  # (action, body, status, words in the message)
        ("restore", {"filename": "../mine.bin"}, 400, "Invalid filename"),
        ("restore", {"filename": str(folder / "mine.bin")}, 400, "Invalid filename"),
        ("save", {"filename": "/tmp/x.bin"}, 400, "Invalid filename"),
        ("save", {"filename": ".."}, 400, "Invalid filename"),
        ("save", {"filename": "a\\b"}, 400, "Invalid filename"),
        ("save", {"filename": ""}, 400, "Invalid filename"),
        ("save", {"filename": "x\n.bin"}, 400, "Invalid filename"),
        ("save", {"filename": "a" * 243}, 400, "Invalid filename"),
        ("save", {"filename": "a" * 255}, 400, "Invalid filename"),
        ("save", {"filename": "é" * 122}, 400, "Invalid filename"),
        ("restore", {"filename": "link.bin"}, 400, "symlink"),
        ("save", {"filename": "out.bin"}, 400, "symlink"),
        ("restore", {"filename": "missing.bin"}, 404, "no slot file"),
        ("restore", {"filename": "other.bin"}, 400, "another model"),
        ("save", {}, 400, "filename"),
        ("save", {"filename": 5}, 400, "filename"),
        ("bogus", {"filename": "mine.bin"}, 400, "Invalid action"),
    ]
    for action, body, status, words in cases:
        r = admin.post(f"/slots/0?action={action}", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
    longest = "a" * 242  # NOTE: with ".NAME.PID.tmp", the engine's temporary name, 255 bytes
    r = admin.post("/slots/0?action=save", json={"filename": longest})
    assert r.status_code == 200 and (folder / longest).is_file(), r.text
    assert Path("/etc/hostname").read_text()  # NOTE: not written through the symlink
    assert os.path.islink(folder / "out.bin") and not (Path("/tmp") / "x.bin").exists()
    r = c.post("/slots/0?action=save", json={"filename": "user.bin"})
    assert r.status_code == 401 and not (folder / "user.bin").exists()
    assert admin.post("/slots/7?action=erase").status_code == 404
    # a server without --slot-save-path answers as llama-server does
    r = server.admin().post("/slots/0?action=save", json={"filename": "x.bin"})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert "--slot-save-path" in r.json()["error"]["message"]
    r = c.post("/completion", json={"prompt": "Still serving", "n_predict": 2})
    assert r.status_code == 200
