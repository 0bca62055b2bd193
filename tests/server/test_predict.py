"""/predict (Vertex AI's prediction protocol): each instance runs as its own route's request."""

from __future__ import annotations

from tests.server.conftest import Server


def test_instances_answer_as_their_routes(server: Server) -> None:
    c = server.client()
    chat = {"model": server.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello"}]}
    r = c.post("/predict", json={"instances": [
        {"@requestFormat": "chatCompletions", **chat, "stream": True},
        {"@requestFormat": "/tokenize", "content": "Say hello"},
        {"@requestFormat": "nothing"}]})
    assert r.status_code == 200, r.text
    first, tokens, missing = r.json()["predictions"]
    direct = c.post("/v1/chat/completions", json=chat).json()
    assert first["object"] == "chat.completion"  # NOTE: stream is turned off
    assert first["choices"][0]["message"] == direct["choices"][0]["message"]
    assert tokens == c.post("/tokenize", json={"content": "Say hello"}).json()
    assert missing["error"]["param"] == "instances.2.@requestFormat"


def test_the_key_and_the_body_are_checked(server: Server) -> None:
    assert server.client(key=None).post("/predict", json={"instances": []}).status_code == 401
    r = server.client().post("/predict", json={"instance": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "instances"
