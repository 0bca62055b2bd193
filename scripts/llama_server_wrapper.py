"""`llama-server` for llama.cpp's server test suite: its flags mapped onto `muser serve`.

Run as `python scripts/llama_server_wrapper.py LLAMA-SERVER-FLAGS...` (the suite starts it through
LLAMA_SERVER_BIN_PATH; `scripts/llama_server_suite.sh` sets that up). The mapping:

    --ctx-size C, --parallel P   --max-model-len C/P, --max-num-seqs P  (llama-server splits its
                                 context between its slots: C/P is one request's context; C defaults
                                 to 4096, P to 4, llama-server's automatic slot count)
    --batch-size N               --max-batched-tokens max(N, P): rows per step
    --alias A[,B...]             --model-name A[,B...]
    --api-key K                  --api-key K --admin-key K  (llama-server has one key for all)
    --port, --host, --seed, --temp, --n-predict, --slot-save-path, --chat-template,
    --chat-template-file, --cors-origins            the same flags
    no --cors-origins            --cors-origins '*'  (llama-server reflects any origin by default;
                                 muser's own default is localhost origins only)
    --metrics (else --no-metrics), --slots | --no-slots       the same switches
    --threads N                  --threads N
    everything else              dropped: model selection (--model, --hf-repo, --hf-file,
                                 --model-url, --offline: the embedded Gemma 3 270M answers),
                                 GPU and KV layout (--n-gpu-layers, -ctk, -ctv, -fa, --kv-unified,
                                 --swa-full, --ubatch-size, --cont-batching: muser always batches),
                                 --jinja / --no-jinja (muser always renders Jinja), --verbose;
                                 features muser lacks are listed in EXCLUDED, not mapped.

EXCLUDED lists the suite's tests that cannot pass against muser, by node-id prefix, with the
reason; the suite script deselects them and records the list in its receipt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

FILES = ("test_basic.py", "test_tokenize.py", "test_completion.py", "test_chat_completion.py",
         "test_ctx_shift.py", "test_ignore_eos.py", "test_infill.py", "test_security.py",
         "test_metrics.py", "test_slot_save.py", "test_template.py", "test_stream.py")

_TEXT = "asserts the tests' own model's (stories260K) text or token counts"
_ROUTER = "llama-server's router mode (several models behind one server)"
_MTMD = "needs multimodal inputs (an mmproj); Gemma 3 270M is text only"
_UI = "llama-server's web UI"
EXCLUDED: dict[str, str] = {}

_PASSTHROUGH = ("--port", "--host", "--seed", "--temp", "--n-predict", "--slot-save-path",
                "--chat-template", "--chat-template-file", "--cors-origins", "--threads")
_DROPPED_VALUE = ("--model", "-m", "--hf-repo", "--hf-file", "--model-url", "--model-draft",
                  "--n-gpu-layers", "-ngl", "-ctk", "-ctv", "-fa", "--ubatch-size", "--pooling",
                  "--reasoning-format", "--reasoning", "--tags", "--models-dir", "--models-max",
                  "--models-preset", "--media-path", "--mmproj-url", "--cache-ram",
                  "--sleep-idle-seconds", "--grp-attn-n", "--grp-attn-w", "--lora",
                  "--spec-type", "--spec-draft-n-max", "--spec-draft-n-min", "--spec-synth-len",
                  "--spec-synth-rates", "--tools", "--tools-runtime", "--mcp-servers-config",
                  "--mcp-servers-json")
_DROPPED_SWITCH = ("--offline", "--cont-batching", "--kv-unified", "--swa-full", "--jinja",
                   "--no-jinja", "--verbose", "--no-ui", "--no-mmproj", "--embedding",
                   "--reranking", "--context-shift", "--no-models-autoload",
                   "--no-cache-idle-slots", "--ui-mcp-proxy", "--backend_sampling")


def muser_args(argv: list[str]) -> list[str]:
    """llama-server flags -> `muser serve` flags (see the module docstring)."""
    p = argparse.ArgumentParser(prog="llama-server", allow_abbrev=False)
    for flag in _PASSTHROUGH + _DROPPED_VALUE:
        p.add_argument(flag, dest=flag.lstrip("-").replace("-", "_"))
    for flag in _DROPPED_SWITCH:
        p.add_argument(flag, action="store_true", dest=flag.lstrip("-").replace("-", "_"))
    p.add_argument("--ctx-size", "-c", type=int, default=4096)
    p.add_argument("--parallel", "-np", type=int, default=4)
    p.add_argument("--batch-size", "-b", type=int)
    p.add_argument("--alias")
    p.add_argument("--api-key")
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True)
    a = p.parse_args(argv)
    out = ["serve", "--device", "cpu", "--max-model-len", str(a.ctx_size // a.parallel),
           "--max-num-seqs", str(a.parallel), "--log-level", "warning"]
    if a.cors_origins is None:
        a.cors_origins = "*"
    for flag in _PASSTHROUGH:
        value = getattr(a, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out += [flag, value]
    if a.batch_size:
        out += ["--max-batched-tokens", str(max(a.batch_size, a.parallel))]
    if a.alias:
        out += ["--model-name", a.alias]
    if a.api_key:
        out += ["--api-key", a.api_key, "--admin-key", a.api_key]
    out += ["--metrics" if a.metrics else "--no-metrics", "--slots" if a.slots else "--no-slots"]
    return out


def main() -> None:
    if sys.argv[1:] == ["--excluded"]:
        print(json.dumps(EXCLUDED, indent=1))
        return
    if sys.argv[1:] == ["--pytest-args"]:
        print("\n".join([f"unit/{f}" for f in FILES] + [f"--deselect={t}" for t in EXCLUDED]))
        return
    args = [sys.executable, "-m", "muser", *muser_args(sys.argv[1:])]
    print("llama-server wrapper:", " ".join(args), file=sys.stderr, flush=True)
    os.execv(sys.executable, args)


if __name__ == "__main__":
    main()
