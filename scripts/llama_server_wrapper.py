"""`llama-server` for llama.cpp's server test suite: its flags mapped onto `muser serve`.

Run as `python scripts/llama_server_wrapper.py LLAMA-SERVER-FLAGS...` (the suite starts it through
LLAMA_SERVER_BIN_PATH; `scripts/llama_server_suite.sh` sets that up). The mapping:

    --ctx-size C, --parallel P   --max-model-len C/P, --max-num-seqs P  (llama-server splits its
                                 context between its slots: C/P is one request's context; C defaults
                                 to 4096, P to 4, llama-server's automatic slot count)
    --kv-unified                 --max-model-len C  (one pool for every slot: any one request may
                                 use the whole context; muser's pages are shared by all sequences)
    --batch-size N               --max-batched-tokens max(N, P): rows per step
    --alias A[,B...], --tags T   the same flags (muser's --alias names the model as
                                 llama-server does: the first alias in alphabetical order)
    --api-key K                  --api-key K --admin-key K  (llama-server has one key for all)
    no --api-key                 --keyless-admin  (a keyless llama-server runs slot actions)
    --port, --host, --seed, --temp, --n-predict, --chat-template, --chat-template-file,
    --cors-origins, --slot-save-path, --reasoning, --sleep-idle-seconds, --pooling
                                 the same flags (--pooling with --embedding only: it acts on
                                 nothing else)
    --embedding(s), --context-shift   the same switches
    no --cors-origins            --cors-origins '*' (llama-server reflects any origin by default,
                                 localhost origins only with --tools; muser's own default is
                                 localhost origins only)
    --metrics (else --no-metrics), --slots | --no-slots, --verbose   the same switches
    --threads N                  --threads N
    (always)                     --grammar-mask-ms 60000 --grammar-compile-s 600: llama-server
                                 puts no time budget on a grammar (muser's defaults, 50 ms a
                                 mask and 2 s a compile, end a constrained request on a
                                 loaded machine where llama-server would wait)
    everything else              dropped: model selection (--model, --hf-repo, --hf-file,
                                 --model-url, --offline: the embedded Gemma 3 270M answers),
                                 GPU and KV layout (--n-gpu-layers, -ctk, -ctv, -fa,
                                 --swa-full, --ubatch-size, --cont-batching: muser always batches),
                                 --jinja / --no-jinja (muser always renders Jinja);
                                 features muser lacks are listed in EXCLUDED, not mapped.

EXCLUDED lists the suite's tests that cannot pass against muser, with the reason; the suite
script loads this file as a pytest plugin (`-p llama_server_wrapper`), which deselects them, and
records the list in its receipt. A key names one test (all its parameters), or ends in '[' (a
prefix of parameter ids) or '.py' (a whole file).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

# NOTE: every file of tools/server/tests/unit; a file that cannot run here at all is one
# EXCLUDED entry with its reason
FILES = ("test_basic.py", "test_tokenize.py", "test_completion.py", "test_chat_completion.py",
         "test_ctx_shift.py", "test_ignore_eos.py", "test_infill.py", "test_security.py",
         "test_metrics.py", "test_slot_save.py", "test_template.py", "test_stream.py",
         "test_sleep.py", "test_tool_call.py", "test_compat_anthropic.py",
         "test_compat_oai_responses.py", "test_compat_gcp.py", "test_embedding.py",
         "test_kv_keep_only_active.py", "test_rerank.py", "test_lora.py", "test_speculative.py",
         "test_proxy.py", "test_router.py", "test_tools_builtin.py", "test_mcp_servers.py",
         "test_vision_api.py")

_TEXT = "asserts the tests' own model's (stories260K) text, token counts or vocabulary"
_ROUTER = "llama-server's router mode (several models behind one server, loaded on demand)"
_MTMD = "needs multimodal inputs (an mmproj and images); Gemma 3 270M is text only"
_UI = "llama-server's web UI (static pages, its MCP/CORS proxy)"
_FIM = "fill-in-the-middle: Gemma 3 has no FIM tokens (muser's /infill answers 501)"
_U = "unit/"
EXCLUDED: dict[str, str] = {
    _U + "test_basic.py::test_load_split_model": "loads a split GGUF from a model hub; " + _TEXT,
    _U + "test_basic.py::test_no_ui": _UI,
    _U + "test_tokenize.py::test_tokenize_with_bos": _TEXT + " (BOS id 1; Gemma's is 2)",
    _U + "test_completion.py::test_completion[": _TEXT,
    _U + "test_completion.py::test_completion_stream[": _TEXT,
    _U + "test_completion.py::test_completion_with_openai_library": _TEXT,
    _U + "test_completion.py::test_completion_stream_with_openai_library": _TEXT,
    _U + "test_completion.py::test_completion_stream_with_openai_library_stops": "fetches "
    "Phi-3.5-mini from a model hub and asserts its text",
    _U + "test_completion.py::test_completion_prompt_cache": _TEXT,
    _U + "test_completion.py::test_nocache_long_input_prompt": _TEXT + " (a prompt over 256 "
    "of its tokens is under 256 of Gemma's)",
    _U + "test_completion.py::test_completion_response_fields[I believe the meaning of life "
    "is-32-response_fields1]": _TEXT + " (the prompt echoed as '<s> ...')",
    _U + "test_chat_completion.py::test_chat_completion[": _TEXT,
    _U + "test_chat_completion.py::test_chat_completion_cached_tokens": _TEXT,
    _U + "test_chat_completion.py::test_chat_completion_stream[": _TEXT,
    _U + "test_chat_completion.py::test_chat_completion_with_openai_library": _TEXT,
    _U + "test_chat_completion.py::test_chat_template": _TEXT + " (the prompt echoed with "
    "its '<s> ' BOS)",
    _U + "test_ctx_shift.py::test_ctx_shift_enabled": _TEXT + " (prompt_n == 226)",
    _U + "test_ctx_shift.py::test_ctx_shift_disabled_short_prompt": _TEXT + " (an 8-token "
    "prompt; 64 tokens without an end-of-generation token)",
    _U + "test_ctx_shift.py::test_ctx_shift_disabled_long_prompt": _TEXT + " (its LONG_TEXT "
    "is over a 256-token context in its vocabulary, 89 tokens in Gemma's; muser refuses "
    "a prompt over the context with the message the test looks for)",
    _U + "test_infill.py": _FIM,
    _U + "test_security.py::test_access_static_assets_without_api_key": _UI,
    _U + "test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers": _UI,
    _U + "test_security.py::test_local_media_file": _MTMD,
    _U + "test_metrics.py::test_metrics_embedding_prompt_is_counted": "selects another model "
    "(an embedding model, bert-bge-small); the wrapper ignores model selection",
    _U + "test_slot_save.py::test_slot_save_restore": _TEXT + " (its first answer matches "
    "'Whiskers|Flana', then prompt_n == 21, n_saved == 84)",
    _U + "test_slot_save.py::test_slot_restore_legacy_token_list": _TEXT + " (n_saved == 84), "
    "then rewrites the file as llama.cpp's own state-file layout (muser's is safetensors)",
    _U + "test_slot_save.py::test_slot_erase": _TEXT + " (its first answer matches "
    "'Whiskers|Flana', then prompt_n == 21)",
    _U + "test_chat_completion.py::test_return_progress[64-4-False]": _TEXT + " (4 progress "
    "reports: its prompt is 3 batches of 64 of its tokens, 49 tokens in Gemma's vocabulary, "
    "one batch: 2 reports)",
    **{_U + "test_slot_save.py::" + name: _MTMD for name in (
        "test_slot_save_restore_with_image", "test_slot_save_restore_with_two_images",
        "test_slot_save_restore_with_image_across_restart",
        "test_slot_save_restore_image_payload_larger_than_context",
        "test_slot_restore_media_file_without_mmproj")},
    _U + "test_stream.py": _ROUTER,
    _U + "test_router.py": _ROUTER,
    _U + "test_tools_builtin.py": _ROUTER + "; its built-in agent tools (--tools: shell, "
    "file edits)",
    _U + "test_mcp_servers.py": _ROUTER + "; its MCP client (--mcp-servers-config)",
    _U + "test_proxy.py": _UI,
    _U + "test_vision_api.py": _MTMD,
    _U + "test_lora.py": "its fixture downloads a LoRA adapter of stories15M from a model hub",
    _U + "test_speculative.py": "its fixture downloads its draft model (stories15M-q4_0) from "
    "a model hub",
    _U + "test_rerank.py": "needs a reranking model (a classification head scoring a query "
    "against a document, jina-reranker); no Gemma model has one",
    _U + "test_kv_keep_only_active.py": "first asserts a line of llama-server's own debug log "
    "(__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__): text of its source, in no API",
    _U + "test_embedding.py::test_embedding_pooling_none": _TEXT + " (5 vectors for 'hello "
    "hello hello': 3 tokens and its [CLS] and [SEP]; Gemma's are 3 and its BOS)",
    _U + "test_embedding.py::test_embedding_usage_single": _TEXT + " (9 and 6 prompt tokens "
    "with [CLS] and [SEP]; 8 and 5 with Gemma's BOS)",
    _U + "test_embedding.py::test_embedding_usage_multiple": _TEXT + " (2 x 9 prompt tokens "
    "with [CLS] and [SEP]; 2 x 8 with Gemma's BOS)",
    _U + "test_compat_oai_responses.py::test_responses_with_openai_library": _TEXT
    + " (its answer matches 'Suddenly')",
    _U + "test_compat_oai_responses.py::test_responses_stream_with_openai_library": _TEXT
    + " (its answer matches 'Suddenly')",
    _U + "test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model": _MTMD
    + "; it downloads tinygemma3 and its test image from a model hub",
    **{_U + "test_compat_anthropic.py::" + name: "asserts status 500 for an image sent to a "
       "text-only model; muser answers 400 (the client's error, a server never answers bad "
       "input with a 500) with the message the test looks for ('image input is not "
       "supported')" for name in (
        "test_anthropic_vision_format_accepted", "test_anthropic_tool_result_with_image")},
    _U + "test_compat_anthropic.py::test_anthropic_thinking_with_reasoning_model": "fetches "
    "DeepSeek-R1-Distill-Qwen-7B from a model hub and asserts its thinking blocks",
    **{_U + "test_tool_call.py::" + name: "fetches a real model from a model hub and asserts "
       "its tool calls or answers" for name in (
        "test_completion_with_required_tool_real_model", "test_completion_without_tool_call_slow",
        "test_weather", "test_calc_result", "test_thoughts", "test_hello_world")},
}

_PASSTHROUGH = ("--port", "--host", "--seed", "--temp", "--n-predict", "--chat-template",
                "--chat-template-file", "--cors-origins", "--threads", "--slot-save-path",
                "--reasoning", "--sleep-idle-seconds", "--pooling")
_SWITCHES = ("--embedding", "--embeddings", "--context-shift")  # muser has the same
_DROPPED_VALUE = ("--model", "-m", "--hf-repo", "--hf-file", "--model-url", "--model-draft",
                  "--n-gpu-layers", "-ngl", "-ctk", "-ctv", "-fa", "--ubatch-size",
                  "--reasoning-format", "--models-dir", "--models-max",
                  "--models-preset", "--media-path", "--mmproj-url", "--cache-ram",
                  "--grp-attn-n", "--grp-attn-w", "--lora",
                  "--spec-type", "--spec-draft-n-max", "--spec-draft-n-min", "--spec-synth-len",
                  "--spec-synth-rates", "--tools", "--tools-runtime", "--mcp-servers-config",
                  "--mcp-servers-json")
_DROPPED_SWITCH = ("--offline", "--cont-batching", "--kv-unified", "--swa-full", "--jinja",
                   "--no-jinja", "--no-ui", "--no-mmproj",
                   "--reranking", "--no-models-autoload",
                   "--no-cache-idle-slots", "--ui-mcp-proxy", "--backend_sampling")


def muser_args(argv: list[str]) -> list[str]:
    """llama-server flags -> `muser serve` flags (see the module docstring)."""
    p = argparse.ArgumentParser(prog="llama-server", allow_abbrev=False)
    for flag in _PASSTHROUGH + _DROPPED_VALUE:
        p.add_argument(flag, dest=flag.lstrip("-").replace("-", "_"))
    for flag in _DROPPED_SWITCH + _SWITCHES:
        p.add_argument(flag, action="store_true", dest=flag.lstrip("-").replace("-", "_"))
    p.add_argument("--ctx-size", "-c", type=int, default=4096)
    p.add_argument("--parallel", "-np", type=int, default=4)
    p.add_argument("--batch-size", "-b", type=int)
    p.add_argument("--alias")
    p.add_argument("--tags")
    p.add_argument("--api-key")
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True)
    a = p.parse_args(argv)
    per_seq = a.ctx_size if a.kv_unified else a.ctx_size // a.parallel
    out = ["serve", "--device", "cpu", "--max-model-len", str(per_seq),
           "--max-num-seqs", str(a.parallel), "--log-level", "warning",
           "--grammar-mask-ms", "60000", "--grammar-compile-s", "600"]
    if a.cors_origins is None:
        a.cors_origins = "localhost" if a.tools else "*"
    if not (a.embedding or a.embeddings):
        a.pooling = None  # NOTE: llama-server's pooling acts only on embeddings
    for flag in _PASSTHROUGH:
        value = getattr(a, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out += [flag, value]
    out += [flag for flag in _SWITCHES if getattr(a, flag.lstrip("-").replace("-", "_"))]
    if a.batch_size:
        out += ["--max-batched-tokens", str(max(a.batch_size, a.parallel))]
    if a.alias:
        out += ["--alias", a.alias]
    if a.tags:
        out += ["--tags", a.tags]
    if a.api_key:
        out += ["--api-key", a.api_key, "--admin-key", a.api_key]
    else:
        out.append("--keyless-admin")
    out += ["--metrics" if a.metrics else "--no-metrics", "--slots" if a.slots else "--no-slots"]
    if a.verbose:
        out.append("--verbose")
    return out


def is_excluded(nodeid: str) -> bool:
    return any(nodeid == key or nodeid.startswith(key + "[") or
               (key.endswith(("[", ".py")) and nodeid.startswith(key)) for key in EXCLUDED)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """As a pytest plugin: deselect the EXCLUDED tests."""
    dropped = [item for item in items if is_excluded(item.nodeid)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not is_excluded(item.nodeid)]


START_TIMEOUT_S = 240  # NOTE: the tests wait 60 s; on a loaded 2-core machine muser takes longer


def pytest_configure(config: Any) -> None:
    """As a pytest plugin, three changes to the tests' harness (tools/server/tests/utils.py),
    none to what a test asserts: ServerPreset.load_all, which starts every preset once before
    any test so that their model files are downloaded, does nothing (the wrapper ignores model
    selection; eight starts for nothing, and one slow start failed the whole session); a
    server gets START_TIMEOUT_S to answer /health 200; under pytest-xdist each worker's servers
    use LLAMA_SUITE_PORT + 10 * its number (the tests' own rule, from 8080, may meet another
    program's server)."""
    import utils  # NOTE: the tests' directory is the working directory, on sys.path

    utils.ServerPreset.load_all = staticmethod(lambda: None)
    start, init = utils.ServerProcess.start, utils.ServerProcess.__init__

    def patient_start(self: Any, timeout_seconds: int = START_TIMEOUT_S) -> None:
        start(self, max(timeout_seconds, START_TIMEOUT_S))

    def own_port(self: Any) -> None:
        init(self)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        if os.environ.get("LLAMA_SUITE_PORT") and worker.isdigit():
            self.server_port = int(os.environ["LLAMA_SUITE_PORT"]) + 10 * int(worker)

    utils.ServerProcess.start, utils.ServerProcess.__init__ = patient_start, own_port
    if os.environ.get("LLAMA_SUITE_REUSE") == "1":
        _reuse_servers(utils)


# NOTE: files whose tests count across requests (metrics totals, slot caches): fresh servers
FRESH_FILES = ("test_metrics.py", "test_slot_save.py")
_current_file = [""]
_parked: dict[tuple[str, ...], Any] = {}  # this worker's server kept running: flags -> process


def pytest_runtest_setup(item: Any) -> None:
    _current_file[0] = os.path.basename(str(item.fspath))


def _reuse_servers(utils: Any) -> None:
    """LLAMA_SUITE_REUSE=1: a test whose server has the same flags as the previous test's (in
    the same worker, outside FRESH_FILES) gets that server, still running, instead of a new one;
    any other start ends it first. State a server keeps between requests (the prefix cache,
    counters) then carries over from test to test."""
    import subprocess

    def popen(args: list[str], **kwargs: Any) -> Any:
        key = tuple(args)
        if (key in _parked and _parked[key].poll() is None
                and _current_file[0] not in FRESH_FILES):
            return _parked.pop(key)
        _end_parked()
        return subprocess.Popen(args, **kwargs)

    stop = utils.ServerProcess.stop

    def park_or_stop(self: Any) -> None:
        proc = self.process
        if (proc is not None and proc.poll() is None and not self.external_server
                and _current_file[0] not in FRESH_FILES):
            _end_parked()
            _parked[tuple(proc.args)] = proc
            self.process = None
        stop(self)

    utils.subprocess = type(subprocess)("subprocess_reusing")
    utils.subprocess.__dict__.update(vars(subprocess), Popen=popen)
    utils.ServerProcess.stop = park_or_stop


def _end_parked() -> None:
    for proc in _parked.values():
        proc.terminate()
        proc.wait(30)
    _parked.clear()


def pytest_unconfigure(config: Any) -> None:
    _end_parked()


def pytest_runtest_logreport(report: Any) -> None:
    """As a pytest plugin: a failure's last traceback line at once, so that a run cut short
    still says why each test failed (the report reads these lines)."""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash else str(report.longrepr).strip().splitlines()[-1]
        reason = " ".join(reason.split())[:300]
        print(f"\nFAILURE-REASON {report.nodeid} {report.when}: {reason}", flush=True)


def main() -> None:
    if sys.argv[1:] == ["--files"]:
        print("\n".join(FILES))
        return
    args = [sys.executable, "-m", "muser", *muser_args(sys.argv[1:])]
    print("llama-server wrapper:", " ".join(args), file=sys.stderr, flush=True)
    if os.environ.get("LLAMA_SUITE_NICE"):  # NOTE: back to the niceness the suite script had
        os.nice(-int(os.environ["LLAMA_SUITE_NICE"]))
    if os.environ.get("LLAMA_SUITE_PIDS"):  # NOTE: the suite script ends the ones left running
        with open(os.environ["LLAMA_SUITE_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\n")
    os.execv(sys.executable, args)


if __name__ == "__main__":
    main()
