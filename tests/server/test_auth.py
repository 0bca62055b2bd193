"""Keys: every route but /health needs one; admin routes need the admin key."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import ADMIN_KEY, API_KEY, FILE_KEYS, Server

GUARDED = [("GET", "/v1/models", None), ("GET", "/props", None), ("GET", "/metrics", None),
           ("POST", "/tokenize", {"content": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
           ("POST", "/completion", {"prompt": "hi", "n_predict": 1}),
           ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
           ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


def _send(c: httpx.Client, method: str, path: str, body: dict | None) -> httpx.Response:
    return c.request(method, path, json=body) if body is not None else c.request(method, path)


def _assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["message"] and "type" in err


@pytest.mark.parametrize("method,path,body", GUARDED)
def test_no_key_or_wrong_key_is_401(server: Server, method: str, path: str,
                                    body: dict | None) -> None:
    _assert_401(_send(server.client(key=None), method, path, body))
    _assert_401(_send(server.client(key="wrong"), method, path, body))


@pytest.mark.parametrize("key", [API_KEY, *FILE_KEYS, ADMIN_KEY])
def test_every_configured_key_works_as_bearer_and_x_api_key(server: Server, key: str) -> None:
    assert server.client(key).get("/v1/models").status_code == 200
    r = httpx.get(server.url + "/v1/models", headers={"X-Api-Key": key})
    assert r.status_code == 200


def test_admin_routes_need_the_admin_key(server: Server) -> None:
    for key in (None, API_KEY, FILE_KEYS[0]):
        _assert_401(server.client(key).get("/slots"))
        _assert_401(server.client(key).post("/slots/0?action=erase"))
    assert server.admin().get("/slots").status_code == 200
    r = server.admin().post("/slots/0?action=erase")
    assert r.status_code == 200 and r.json()["id_slot"] == 0


def test_health_is_open(server: Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
