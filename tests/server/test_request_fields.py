"""Nothing silently ignored: every field of the OpenAI request schemas (the openai package's typed
params) and of llama.cpp's /completion is either honoured or refused with a 400 naming it.

Verdicts per probe (field, value):
    honoured  200, and the response differs from the same request without the field
    accepted  200: the value is what this server does anyway (n_keep: 0, store: false, a model
              name, an end user's id), or its effect is asserted by another test (named)
    refused   400 whose error.param names the field
The walk fails when a schema gains a field that no probe covers.
"""

from __future__ import annotations

import json
import typing

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from tests.server.conftest import MAX_NUM_SEQS, Server

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a city."}]
HOT = {"temperature": 1.5, "seed": 1}
DROP = "<drop>"  # an extra field with this value is left out of probe and baseline
GBNF = 'root ::= "Paris" | "Lyon"'
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}},
          "required": ["city"]}

# (field, value, verdict, extra fields of both the probe and its baseline)
SHARED = [
    ("max_tokens", 1, "honoured", {}), ("temperature", 1.5, "honoured", {"seed": 1}),
    ("top_p", 0.05, "honoured", HOT), ("seed", 2, "honoured", HOT),
    ("stop", [" "], "honoured", {}), ("stream", True, "honoured", {}),
    ("stream_options", {"include_usage": True}, "honoured", {"stream": True}),
    ("stream_options", {"include_obfuscation": True}, "refused", {"stream": True}),
    # NOTE: the penalties' effect: tests/test_sampler.py, tests/server/test_logprobs_samples.py
    ("frequency_penalty", 0.5, "accepted", {}), ("presence_penalty", 0.5, "accepted", {}),
    ("n", 2, "honoured", {}), ("logprobs", 2, "honoured", {}),
    ("logit_bias", {"15": 100}, "honoured", {}), ("user", "user-1", "accepted", {}),
    ("grammar", GBNF, "honoured", {}), ("json_schema", SCHEMA, "honoured", {}),
    ("response_format", {"type": "json_object"}, "honoured", {}),
    ("response_format", {"type": "text"}, "accepted", {}),
    ("model", None, "accepted", {}), ("no_such_field", 1, "refused", {}),
]
COMPLETIONS = SHARED + [
    ("prompt", "Once upon a time", "honoured", {}), ("echo", True, "honoured", {}),
    ("best_of", 3, "honoured", HOT), ("suffix", "!", "refused", {}),
]
CHAT = [p for p in SHARED if p[0] != "logprobs"] + [
    ("messages", [{"role": "user", "content": "Count to three."}], "honoured", {}),
    ("max_completion_tokens", 1, "honoured", {}), ("logprobs", True, "honoured", {}),
    ("top_logprobs", 2, "honoured", {"logprobs": True}), ("top_logprobs", 2, "refused", {}),
    ("response_format", {"type": "json_schema", "json_schema": {
        "name": "city", "schema": SCHEMA, "strict": True}}, "honoured", {}),
    # NOTE: tools' calls and their shapes: tests/server/test_tools.py
    ("tools", [{"type": "function", "function": {"name": "f"}}], "honoured", {}),
    ("tools", [{"type": "function", "function": {"name": "f", "x": 1}}], "refused", {}),
    ("tool_choice", "none", "accepted", {}), ("tool_choice", "auto", "refused", {}),
    ("tool_choice", "required", "honoured", {"tools": [{"type": "function", "function": {
        "name": "f"}}]}),
    # llama-server's (tests/server/test_pinned_slots.py: the slot, the timings' values)
    ("id_slot", 0, "accepted", {}), ("id_slot", MAX_NUM_SEQS, "refused", {}),
    ("timings_per_token", True, "accepted", {}),
    ("return_progress", True, "honoured", {"stream": True}),
    ("return_progress", True, "refused", {}),
    ("parallel_tool_calls", False, "accepted", {}),  # with tools: tests/server/test_tools.py
    ("parallel_tool_calls", "no", "refused", {}),
    # NOTE: the template's enable_thinking for one request: tests/server/test_templates.py
    ("chat_template_kwargs", {"enable_thinking": False}, "accepted", {}),
    ("chat_template_kwargs", {"tools": []}, "refused", {}), ("functions", [{"name": "f"}], "refused", {}),
    ("function_call", "none", "refused", {}), ("store", False, "accepted", {}),
    ("store", True, "refused", {}), ("service_tier", "auto", "accepted", {}),
    ("service_tier", "priority", "refused", {}), ("modalities", ["text"], "accepted", {}),
    ("modalities", ["text", "audio"], "refused", {}),
    ("audio", {"voice": "alloy", "format": "wav"}, "refused", {}),
    ("metadata", {"k": "v"}, "refused", {}), ("moderation", {"k": "v"}, "refused", {}),
    ("prediction", {"type": "content", "content": "x"}, "refused", {}),
    ("prompt_cache_key", "k", "refused", {}), ("prompt_cache_options", {"k": 1}, "refused", {}),
    ("prompt_cache_retention", "24h", "refused", {}),
    ("reasoning_effort", "low", "refused", {}), ("safety_identifier", "s", "refused", {}),
    ("verbosity", "low", "refused", {}), ("web_search_options", {}, "refused", {}),
]
# llama.cpp's /completion options: tools/server/README.md and server-schema.cpp (llama.cpp as
# vendored by llama-cpp-python 0.3.36)
LLAMA_FIELDS = (  # noqa: SIM905 (as the docs list them)
    "prompt temperature dynatemp_range dynatemp_exponent top_k top_p min_p n_predict n_indent "
    "n_keep n_cmpl n_cache_reuse stream stop typical_p repeat_penalty repeat_last_n "
    "presence_penalty frequency_penalty dry_multiplier dry_base dry_allowed_length "
    "dry_penalty_last_n dry_sequence_breakers xtc_probability xtc_threshold mirostat "
    "mirostat_tau mirostat_eta grammar json_schema seed ignore_eos logit_bias n_probs min_keep "
    "t_max_predict_ms id_slot cache_prompt return_tokens samplers timings_per_token "
    "return_progress sse_ping_interval post_sampling_probs response_fields lora verbose "
    "stream_options max_tokens max_completion_tokens n_discard n t_max_prompt_ms top_n_sigma "
    "adaptive_target adaptive_decay logprobs backend_sampling chat_format reasoning_format "
    "generation_prompt parse_tool_calls chat_parser continue_final_message echo "
    "preserved_tokens grammar_triggers grammar_lazy reasoning_control reasoning_budget_tokens "
    "reasoning_budget_start_tag reasoning_budget_end_tags reasoning_budget_end_tag "
    "reasoning_budget_message").split()
OFF = {"typical_p": (1.0, 0.9), "dynatemp_range": (0.0, 0.5), "top_n_sigma": (-1.0, 1.0),
       "xtc_probability": (0.0, 0.5), "mirostat": (0, 2), "dry_multiplier": (0.0, 0.8),
       "min_keep": (0, 5), "grammar_lazy": (False, True), "n_indent": (0, 4),
       "n_keep": (0, 8), "n_discard": (0, 4), "n_cache_reuse": (0, 256),
       "t_max_predict_ms": (0, 100), "t_max_prompt_ms": (-1, 100),
       "lora": ([], [{"id": 0, "scale": 1.0}])}
# sub-parameters of samplers that are off unless their switch is on (llama.cpp ignores them too)
SUBORDINATE = {"dynatemp_exponent": 2.0, "xtc_threshold": 0.2, "mirostat_tau": 4.0,
               "mirostat_eta": 0.2, "dry_base": 2.0, "dry_allowed_length": 3,
               "dry_penalty_last_n": 32, "dry_sequence_breakers": ["\n"]}
LLAMA_NAMED = [
    ("prompt", "Once upon a time", "honoured", {}), ("temperature", 1.5, "honoured", {"seed": 1}),
    ("top_k", 1, "honoured", HOT), ("top_p", 0.05, "honoured", HOT),
    ("min_p", 0.5, "honoured", HOT), ("seed", 2, "honoured", HOT),
    ("n_predict", 1, "honoured", {}), ("max_tokens", 1, "honoured", {"n_predict": DROP, "max_tokens": 6}),
    ("max_completion_tokens", 1, "honoured", {"n_predict": DROP, "max_completion_tokens": 6}),
    ("stream", True, "honoured", {}),
    ("stop", [" "], "honoured", {}), ("repeat_penalty", 5.0, "honoured", {}),
    ("repeat_last_n", 0, "honoured", {"repeat_penalty": 5.0}),
    ("grammar", GBNF, "honoured", {}), ("json_schema", SCHEMA, "honoured", {}),
    ("return_tokens", True, "honoured", {}), ("response_fields", ["content"], "honoured", {}),
    ("ignore_eos", True, "accepted", {}),  # test_llama_compat: generation_settings, lengths
    ("cache_prompt", False, "accepted", {}),  # the prefix cache gives the same tokens
    ("model", None, "accepted", {}), ("id_slot", -1, "accepted", {}),
    ("id_slot", 0, "honoured", {}), ("id_slot", MAX_NUM_SEQS, "refused", {}),
    # NOTE: the timings' values: tests/server/test_pinned_slots.py (they differ run to run)
    ("timings_per_token", True, "accepted", {"stream": True}),
    ("timings_per_token", False, "accepted", {}),
    ("return_progress", True, "honoured", {"stream": True}),
    ("return_progress", True, "refused", {}), ("return_progress", False, "accepted", {}),
    ("post_sampling_probs", True, "honoured", {"n_probs": 2}),
    ("post_sampling_probs", True, "refused", {}), ("post_sampling_probs", False, "accepted", {}),
    # NOTE: the penalties' effect: tests/server/test_logprobs_samples.py
    ("presence_penalty", 0.5, "accepted", {}), ("frequency_penalty", 0.5, "accepted", {}),
    ("n_probs", 2, "honoured", {}), ("logprobs", 2, "refused", {}), ("n", 2, "honoured", {}),
    ("n_cmpl", 2, "honoured", {}), ("n_cmpl", MAX_NUM_SEQS + 1, "refused", {}),
    ("echo", True, "refused", {}),
    ("logit_bias", [[15, 100]], "honoured", {}), ("samplers", ["top_k"], "refused", {}),
    ("no_such_field", 1, "refused", {}),
]
_COVERED = {p[0] for p in LLAMA_NAMED} | set(OFF) | set(SUBORDINATE)
LLAMA = LLAMA_NAMED + [(f, off, "accepted", {}) for f, (off, _) in OFF.items()] + [
    (f, on, "refused", {}) for f, (_, on) in OFF.items()] + [
    (f, v, "accepted", {}) for f, v in SUBORDINATE.items()] + [
    (f, "x", "refused", {}) for f in LLAMA_FIELDS if f not in _COVERED]


def _fields(params: type) -> set[str]:
    return set(typing.get_type_hints(params)) | {"stream"}


def test_the_probes_cover_every_schema_field() -> None:
    assert _fields(completion_create_params.CompletionCreateParamsBase) <= {
        p[0] for p in COMPLETIONS}
    assert _fields(chat_create_params.CompletionCreateParamsBase) <= {p[0] for p in CHAT}
    assert set(LLAMA_FIELDS) <= {p[0] for p in LLAMA}


def _observed(r: httpx.Response) -> object:
    """The response without what differs between any two requests (ids, times)."""
    drop = {"id", "created", "timings", "generation_settings"}
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        return ["stream"] + [e if e == "[DONE]" else {k: v for k, v in json.loads(e).items()
                                                      if k not in drop} for e in events]
    body = r.json()
    return [{k: v for k, v in b.items() if k not in drop} for b in body] if isinstance(
        body, list) else {k: v for k, v in body.items() if k not in drop}


def _probe(server: Server, path: str, base: dict, probe: tuple) -> None:
    field, value, verdict, extra = probe
    c = server.client()
    base = {k: v for k, v in (base | extra).items() if v != DROP}
    body = base | {field: server.model if field == "model" else value}
    r = c.post(path, json=body)
    if verdict == "refused":
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"].split(".")[0] == field, r.text
        return
    assert r.status_code == 200, (field, value, r.text)
    if verdict == "honoured":
        baseline = c.post(path, json=base)
        assert baseline.status_code == 200, baseline.text
        assert _observed(r) != _observed(baseline), (field, value)


@pytest.mark.parametrize("probe", COMPLETIONS, ids=lambda p: f"{p[0]}={p[1]!r}"[:60])
def test_completions_field(server: Server, probe: tuple) -> None:
    _probe(server, "/v1/completions", {"model": server.model, "prompt": PROMPT,
                                       "max_tokens": 6, "temperature": 0}, probe)


@pytest.mark.parametrize("probe", CHAT, ids=lambda p: f"{p[0]}={p[1]!r}"[:60])
def test_chat_field(server: Server, probe: tuple) -> None:
    _probe(server, "/v1/chat/completions", {"model": server.model, "messages": MESSAGES,
                                            "max_tokens": 6, "temperature": 0}, probe)


@pytest.mark.parametrize("probe", LLAMA, ids=lambda p: f"{p[0]}={p[1]!r}"[:60])
def test_llama_completion_field(server: Server, probe: tuple) -> None:
    _probe(server, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0}, probe)


def test_tokenize_fields(server: Server) -> None:
    """/tokenize's options (llama.cpp's README): content, add_special, parse_special,
    with_pieces are honoured; anything else is refused by name."""
    c = server.client()
    base = {"content": "<end_of_turn>x"}
    seen = [c.post("/tokenize", json=base | extra).json() for extra in (
        {}, {"add_special": True}, {"parse_special": False}, {"with_pieces": True})]
    assert len({json.dumps(s) for s in seen}) == 4, seen
    r = c.post("/tokenize", json=base | {"special": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "special", r.text
