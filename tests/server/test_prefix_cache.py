"""Prefix reuse over HTTP: a prompt that begins with one computed before reports the reused
tokens in the OpenAI usage, and /metrics counts hits, reused tokens and evictions."""

from __future__ import annotations

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, Server


def test_a_continued_prompt_reports_cached_tokens(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    ids = [2] + [1000 + (i * 7919) % 50_000 for i in range(299)]
    first = client.completions.create(model=server.model, prompt=ids, max_tokens=1,
                                      temperature=0)
    # NOTE: one new token: the sequence ends with the prompt's 300 rows, all of them cached
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=server.model, prompt=ids + [1017, 563, 2048],
                                      max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens == 303
    assert again.usage.prompt_tokens_details.cached_tokens == 300
    text = server.client().get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["muser_prefix_cache_hits"].samples[0].value >= 1
    assert families["muser_prefix_cache_tokens_reused"].samples[0].value >= 300
    kinds = {s.labels["kind"] for s in families["muser_prefix_cache_evictions"].samples}
    assert kinds == {"page", "checkpoint"}
    assert families["muser_prefix_cache_checkpoint_slots"].samples[0].value > 0
