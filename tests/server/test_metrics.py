"""/metrics in Prometheus text format, read with prometheus-client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Server


def test_metrics_cover_latency_queues_tokens_and_routes(server: Server) -> None:
    c = server.client()
    c.post("/completion", json={"prompt": "Hello", "n_predict": 3, "temperature": 0})
    c.post("/completion", json={"prompt": "Hello", "n_predict": "three"})
    response = c.get("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    names = {name for name, _ in response.headers.raw}
    assert b"Process-Start-Time-Unix" in names  # NOTE: as sent; llama-server's casing
    for name in ("muser_ttft_seconds", "muser_tpot_seconds"):
        assert families[name].type == "histogram"
        count = [s for s in families[name].samples if s.name == name + "_count"]
        assert count[0].value >= 1
    depth = {s.labels["work_class"] for s in families["muser_queue_depth"].samples}
    steps = {s.labels["kind"]: s.value for s in families["muser_steps"].samples
             if s.name == "muser_steps_total"}
    assert depth == {"decode", "prefill"} and set(steps) == {"decode", "prefill", "mixed"}
    assert steps["decode"] >= 2 and steps["prefill"] >= 1
    assert families["muser_preemptions"].samples[0].value == 0
    assert families["muser_prompt_tokens"].samples[0].value >= 2
    assert families["muser_generation_tokens"].samples[0].value >= 3
    requests = {(s.labels["route"], s.labels["code"]) for s in families["muser_requests"].samples
                if s.name == "muser_requests_total"}
    assert {("/completion", "200"), ("/completion", "400")} <= requests
    errors = {(s.labels["route"], s.labels["code"])
              for s in families["muser_request_errors"].samples
              if s.name == "muser_request_errors_total"}
    assert ("/completion", "400") in errors and ("/completion", "200") not in errors


def _gauge(text: str, name: str) -> float:
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name)


def test_throughput_gauges_cover_the_window_since_the_last_scrape(server: Server) -> None:
    c = server.client()
    c.post("/completion", json={"prompt": "Hello", "n_predict": 4, "temperature": 0})
    first, second = c.get("/metrics").text, c.get("/metrics").text
    for name in ("llamacpp:predicted_tokens_seconds", "llamacpp:prompt_tokens_seconds"):
        assert _gauge(first, name) > 0 and _gauge(second, name) == 0
    # NOTE: the probes are no traffic: scrapes and /health, /props between them change nothing
    c.get("/health"), c.get("/props")
    assert c.get("/metrics").text == second
