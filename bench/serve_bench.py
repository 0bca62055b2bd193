"""Serving benchmark: fixed workloads streamed through the official `openai` client against
`muser serve`, each set against the bound of the engine's own ceilings.

    python bench/serve_bench.py --out R.json                  # w1, w2, adaptive (served)
    python bench/serve_bench.py --phases w3,w4 --out R.json   # chat and agent, per variant
    python bench/serve_bench.py --ceilings --out R.json       # ceilings, cap-sweep, hf
    python bench/serve_bench.py --phases none --out R.json --plot R.png

Phases (--phases, comma-separated):
    w1         --w1-requests at --w1-concurrency, --w1-prompt tokens in, --w1-output out
    w2         --w2-requests at --w2-concurrency, prompt and output lengths uniform in the
               --w2-prompt and --w2-output spans (seeded)
    adaptive   --adaptive-streams streams decode when an --adaptive-prompt-token prompt
               arrives: their gaps while it prefills, on an adaptive and on a fixed server
    w3         chat: --w3-conversations of --w3-turns turns, --w3-concurrency at once, each
               turn the whole history (a --w3-system-token shared system prompt, the earlier
               turns and answers) + --w3-user new tokens, --w3-output out; idle gaps between
               a conversation's turns, exponential of mean --w3-gap-s (seeded)
    w4         agent: the same with --w4-agents sharing a --w4-preamble-token tool preamble,
               --w4-steps steps of --w4-input tokens in and --w4-output out, --w4-concurrency
               at once, gaps of mean --w4-gap-s (the tool running) (bench/serve_dialogues.py)
    ceilings   in process: prefill tok/s of one fresh sequence's --prefill-chunk rows, and the
               decode-only step at each batch after --ceiling-context-token prompts
    cap-sweep  in process: W1 through llm.engine at each decode_waiting_chunk cap in --caps
    hf         transformers generate() on the same weights at W1's shapes (batch = concurrency)
Served phases start `python -m muser serve` on a free 127.0.0.1 port with an API key, wait for
/health (503 while it loads and warms up), run, and stop it with SIGTERM. W3 and W4 run, in that
order, on one server per --variants entry: its flags added to the serve flags (off: no prefix
cache; on; fp8: + FP8 KV; host: + a --kv-host-gb host tier); a variant whose server does not
start (a flag it refuses) is a cell with `server_error`. In-process phases run after any server
has stopped (one GPU holds one copy of the weights). Every wait is bounded.

Prompts are seeded random ids in [10, 1000); every request has ignore_eos and a fixed
max_tokens. A request is an error when it raised or produced another number of tokens than
max_tokens (the stream's final `usage`; the server sends one chunk per token). W3 and W4 stream
through /completion (its chunks carry the token ids the next turn resends) with httpx.

Bound (bench/serve_receipt.py): requests in waves of `concurrency`; a wave takes its prompt
tokens / the prefill rate + (output tokens per request) decode-only steps at its batch;
fraction_of_bound = output tok/s / (output tokens / bound seconds). --out merges into the file:
a phase re-run for a model replaces that model's entries and keeps the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from serve_dialogues import Dialogue, dialogue_fields, run_dialogue
from serve_receipt import (
    Stream,
    cell_line,
    gap_summary,
    merge,
    plot,
    random_prompts,
    summarize,
    waves,
)

KEY = "serve-bench-key"
SERVED = ("w1", "w2", "adaptive", "w3", "w4")
VARIANTS = {"off": "--no-prefix-cache", "on": "--prefix-cache",
            "fp8": "--prefix-cache --kv-cache-dtype fp8",
            "host": "--prefix-cache --kv-host-gb {kv_host_gb}"}
IN_PROCESS = ("ceilings", "cap-sweep", "hf")
SERVE_FLAGS = (("model", str), ("device", str), ("dtype", str), ("load_format", str),
               ("model_config", str), ("max_model_len", int), ("prefill_chunk", int),
               ("max_num_seqs", int), ("max_batched_tokens", int),
               ("decode_waiting_chunk", int), ("gpu_memory_utilization", float),
               ("quantization", str), ("gguf_weights", str))
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def workload(args: argparse.Namespace, name: str) -> tuple[list[list[int]], list[int], int]:
    """W1 or W2 -> (prompts, max_tokens per request, concurrency), from --seed."""
    if name == "w1":
        n = args.w1_requests
        return (random_prompts(args.seed + 1, [args.w1_prompt] * n), [args.w1_output] * n,
                args.w1_concurrency)
    rng = random.Random(args.seed + 2)
    lengths = [rng.randint(*args.w2_prompt) for _ in range(args.w2_requests)]
    outputs = [rng.randint(*args.w2_output) for _ in range(args.w2_requests)]
    return random_prompts(args.seed + 3, lengths), outputs, args.w2_concurrency


def serve_flags(args: argparse.Namespace) -> list[str]:
    """The `muser serve` flags given to this script (passed through only when given)."""
    flags = []
    for name, _ in SERVE_FLAGS:
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags


def cell_head(args: argparse.Namespace, workload_name: str, policy: str, requests: int,
              concurrency: int, decode_batch: int) -> dict:
    """What every cell says about what ran, and where."""
    return {"model": model_label(args), "workload": workload_name, "chunk_policy": policy,
            "requests": requests, "concurrency": concurrency, "decode_batch": decode_batch,
            "device": args.device or ("cuda" if gpu_info() else "cpu"),
            "serve_flags": serve_flags(args), "date": time.strftime("%Y-%m-%d %H:%M")}


# ---------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(SystemExit):
    """The server exited or did not get ready. NOTE: uncaught, it ends the script with its
    message; the W3/W4 variants catch it as an error cell."""


@contextmanager
def serve(args: argparse.Namespace, policy: str, variant: str = "", flags: tuple[str, ...] = ()):
    """`muser serve` (the serve flags, then `flags`) on a free loopback port while the block
    runs -> its URL."""
    port = free_port()
    args.logs.mkdir(parents=True, exist_ok=True)
    name = "_".join(filter(None, (model_label(args), policy, variant, time.strftime("%H%M%S"))))
    log = args.logs / f"serve_{name}.log"
    cmd = [sys.executable, "-m", "muser", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--api-key", KEY, "--chunk-policy", policy, "--drain-timeout", "10",
           "--log-level", args.log_level, *serve_flags(args), *flags]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        say(f"server ({policy} chunks) ready in {wait_ready(proc, url, args, log):.1f} s, "
            f"log {log}")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        say(f"server stopped (exit {proc.returncode})")


def wait_ready(proc: subprocess.Popen, url: str, args: argparse.Namespace, log: Path) -> float:
    """Poll /health until 200 -> seconds waited; exits if the server dies or times out."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < args.start_timeout and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    raise ServerFailed(f"server not ready (exit {proc.poll()}, {time.monotonic() - t0:.0f} s); "
                       f"its log ends:\n{tail}")


# ---------------------------------------------------------------- the client
def client(url: str, timeout: float):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=url + "/v1", api_key=KEY, timeout=timeout, max_retries=0)


async def stream_one(api, model: str, prompt: list[int], rec: Stream) -> None:
    """One streamed /v1/completions request; `rec` fills in as chunks arrive."""
    rec.sent = time.perf_counter()
    try:
        stream = await api.completions.create(
            model=model, prompt=prompt, max_tokens=rec.max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async with stream:
            async for chunk in stream:
                if chunk.choices:
                    rec.stamps.append(time.perf_counter())
                if chunk.usage is not None:
                    rec.usage = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001  (whatever one request raises is its error)
        rec.error = f"{type(exc).__name__}: {exc}"[:300]


async def served_model(url: str, api) -> tuple[str, int]:
    """The served model's name and context length (/v1/models, /props)."""
    import httpx

    name = (await api.models.list()).data[0].id
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        props = (await c.get(url + "/props")).raise_for_status().json()
    return name, props["default_generation_settings"]["n_ctx"]


async def run_requests(url: str, prompts: list[list[int]], outputs: list[int],
                       concurrency: int, timeout: float, start_at: float = 0.0
                       ) -> tuple[list[Stream], float, float]:
    """Every request, `concurrency` in flight (the next sent as one ends), the first sent at
    `start_at` (perf_counter) or after the warm-up -> the streams, the first send and the last
    end; requests still running after `timeout` are cancelled (errors)."""
    api = client(url, timeout)
    model, _ = await served_model(url, api)
    await stream_one(api, model, prompts[0][:16], Stream(len(prompts[0][:16]), 4))  # warm-up
    recs = [Stream(len(p), n) for p, n in zip(prompts, outputs)]
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int], rec: Stream) -> None:
        async with sem:
            await stream_one(api, model, prompt, rec)

    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    t0 = time.perf_counter()
    tasks = {asyncio.create_task(one(p, r)): r for p, r in zip(prompts, recs)}
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    t1 = time.perf_counter()
    await cancel(pending)
    for task in pending:
        tasks[task].error = f"not finished after {timeout} s"
    await api.close()
    return recs, t0, t1


def client_shard(url: str, prompts: list[list[int]], outputs: list[int], concurrency: int,
                 timeout: float, start_at: float) -> tuple[list[Stream], float, float]:
    """run_requests in a process of its own (--clients)."""
    return asyncio.run(run_requests(url, prompts, outputs, concurrency, timeout, start_at))


def run_clients(url: str, prompts: list[list[int]], outputs: list[int], concurrency: int,
                args: argparse.Namespace) -> tuple[list[Stream], float]:
    """The requests from --clients processes, each with every n-th request and 1/n of the
    concurrency, all starting at one moment (so one client's parsing cannot cap the token
    rate) -> the streams and the wall seconds from the first send to the last end."""
    n = args.clients
    if n == 1:
        recs, t0, t1 = asyncio.run(run_requests(url, prompts, outputs, concurrency, args.timeout))
        return recs, t1 - t0
    if concurrency % n:
        raise SystemExit(f"--clients {n} must divide the concurrency {concurrency}")
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    start_at = time.perf_counter() + args.client_start_s  # NOTE: CLOCK_MONOTONIC, one per host
    with ProcessPoolExecutor(n, mp_context=get_context("spawn")) as pool:
        parts = list(pool.map(client_shard, [url] * n, [prompts[i::n] for i in range(n)],
                              [outputs[i::n] for i in range(n)], [concurrency // n] * n,
                              [args.timeout] * n, [start_at] * n))
    recs = [r for part, _, _ in parts for r in part]
    return recs, max(p[2] for p in parts) - min(p[1] for p in parts)


async def cancel(tasks) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def long_prompt_arrives(url: str, args: argparse.Namespace) -> dict:
    """Streams decode; a long prompt (max_tokens 1) arrives once each has 3 tokens; the
    streams run on for a tail after its first token, then are cancelled."""
    api = client(url, args.timeout)
    model, n_ctx = await served_model(url, api)
    short = random_prompts(args.seed + 4, [16] * args.adaptive_streams)
    long_ids = random_prompts(args.seed + 5, [args.adaptive_prompt])[0]
    await stream_one(api, model, short[0], Stream(16, 4))  # warm-up
    streams = [Stream(16, min(4000, n_ctx - 17)) for _ in short]
    tasks = [asyncio.create_task(stream_one(api, model, p, s)) for p, s in zip(short, streams)]
    deadline = time.monotonic() + args.timeout
    while (min(len(s.stamps) for s in streams) < 3 and time.monotonic() < deadline
           and not any(s.error for s in streams)):
        await asyncio.sleep(0.01)
    before = [g for s in streams for g in s.gaps]
    long = Stream(len(long_ids), 1)
    await asyncio.wait_for(stream_one(api, model, long_ids, long), args.timeout)
    # NOTE: the tail shows the streams recover in the trace
    await asyncio.sleep(min(10.0, max(1.0, 20 * statistics.median(before or [0.0]))))
    await cancel(tasks)
    await api.close()
    return gap_summary(streams, long)


def run_workload(url: str, args: argparse.Namespace, name: str, policy: str) -> dict:
    prompts, outputs, concurrency = workload(args, name)
    recs, wall = run_clients(url, prompts, outputs, concurrency, args)
    lens = [len(p) for p in prompts]
    cell = cell_head(args, name.upper(), policy, len(prompts), concurrency,
                     min(concurrency, len(prompts)))
    cell |= {"clients": args.clients, "prompt_tokens": sum(lens), "output_tokens": sum(outputs),
             "waves": waves(lens, outputs, concurrency)} | summarize(recs, wall)
    errors = [r.error for r in recs if r.error]
    return cell | ({"first_error": errors[0]} if errors else {})


def run_adaptive(url: str, args: argparse.Namespace, policy: str) -> dict:
    n = args.adaptive_streams
    cell = cell_head(args, "adaptive", policy, n + 1, n + 1, n)
    return cell | asyncio.run(long_prompt_arrives(url, args))


def dialogue(args: argparse.Namespace, name: str) -> Dialogue:
    """W3 or W4's shape from the flags."""
    if name == "w3":
        return Dialogue("W3", args.w3_conversations, args.w3_turns, args.w3_system, args.w3_user,
                        args.w3_output, args.w3_concurrency, args.w3_gap_s, args.seed + 6)
    return Dialogue("W4", args.w4_agents, args.w4_steps, args.w4_preamble, args.w4_input,
                    args.w4_output, args.w4_concurrency, args.w4_gap_s, args.seed + 10)


def dialogue_head(args: argparse.Namespace, d: Dialogue, variant: str, flags: tuple[str, ...]
                  ) -> dict:
    cell = cell_head(args, d.name, args.chunk_policy, d.conversations * d.turns, d.concurrency,
                     min(d.concurrency, d.conversations))
    return cell | {"variant": variant, "variant_flags": list(flags)} | d.fields()


def dialogue_phases(args: argparse.Namespace, publish: Callable[[dict], dict]) -> None:
    """W3 then W4 (those in --phases) on one server per variant."""
    todo = [dialogue(args, n) for n in ("w3", "w4") if n in args.phases]
    for variant, flags in args.variants:
        try:
            with serve(args, args.chunk_policy, variant, flags) as url:
                for d in todo:
                    recs, wall, before, after = asyncio.run(
                        run_dialogue(url, KEY, d, args.timeout))
                    cell = dialogue_head(args, d, variant, flags) | dialogue_fields(
                        recs, wall, before, after)
                    say(cell_line(publish({"cells": [cell]})["cells"][-1]))
        except ServerFailed as exc:
            say(f"variant {variant} ({' '.join(flags)}): {exc}")
            lines = str(exc).splitlines()  # NOTE: the last is the log's, e.g. argparse's error
            error = f"{lines[0]} {lines[-1]}"
            publish({"cells": [dialogue_head(args, d, variant, flags) | {"server_error": error}
                               for d in todo]})


def served_phases(args: argparse.Namespace, publish: Callable[[dict], dict]) -> None:
    """One server per chunk policy needed: W1 and W2 on --chunk-policy's, adaptive on both;
    then one per variant for W3 and W4."""
    openai = {"w1", "w2", "adaptive"} & set(args.phases)
    if openai and importlib.util.find_spec("openai") is None:  # before minutes of start-up
        raise SystemExit("the served phases stream through the `openai` client, which is not "
                         "installed: pip install -e '.[dev]' (it pins openai)")
    other = "fixed" if args.chunk_policy == "adaptive" else "adaptive"
    for policy in (args.chunk_policy, other):
        todo = [p for p in ("w1", "w2") if p in args.phases and policy == args.chunk_policy]
        todo += ["adaptive"] if "adaptive" in args.phases else []
        if not todo:
            continue
        with serve(args, policy) as url:
            import httpx

            batching = httpx.get(url + "/props", headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=30).json().get("batching")
            for name in todo:
                cell = (run_adaptive(url, args, policy) if name == "adaptive"
                        else run_workload(url, args, name, policy)) | {"batching": batching}
                say(cell_line(publish({"cells": [cell]})["cells"][-1]))  # merged last
    if {"w3", "w4"} & set(args.phases):
        dialogue_phases(args, publish)


# ---------------------------------------------------------------- in process
def llm_phases(args: argparse.Namespace, publish: Callable[[dict], dict]) -> None:
    from serve_ceilings import llm_kwargs, release

    from muser import LLM

    say("in process: LLM(...) with the serving flags")
    llm = LLM(progress=sys.stderr.isatty(), **llm_kwargs(serve_flags(args), args.chunk_policy))
    if "ceilings" in args.phases:
        publish({"ceilings": {model_label(args): ceilings(llm, args)}})
    if "cap-sweep" in args.phases:
        publish({"cap_sweep": {model_label(args): cap_sweep(llm, args)}})
    del llm
    release()


def ceilings(llm, args: argparse.Namespace) -> dict:
    from serve_ceilings import decode_step_ms, prefill_rate

    out = prefill_rate(llm, args.ceiling_reps)
    say(f"ceilings: {out['prefill_chunk_rows']}-row prefill chunk at "
        f"{out['prefill_tok_s']:.0f} tok/s")
    limit = llm.config.max_num_seqs
    wanted = set(args.decode_batches) | {args.w1_concurrency, args.w2_concurrency,
                                          args.adaptive_streams}
    out["decode_step_ms"] = {}
    for batch in sorted(b for b in wanted if b <= limit):
        step = decode_step_ms(llm, batch, args.ceiling_context, args.decode_steps)
        out["decode_step_ms"][batch] = step
        say(f"ceilings: decode-only step at batch {batch}: {step:.3f} ms")
    return out | {"context": args.ceiling_context, "max_num_seqs": limit,
                  "skipped_batches": sorted(b for b in wanted if b > limit),
                  "device": llm.config.device, "dtype": llm.config.dtype,
                  "kv_dtype": llm.config.kv_dtype, "serve_flags": serve_flags(args)}


def cap_sweep(llm, args: argparse.Namespace) -> list[dict]:
    from serve_ceilings import engine_run, set_cap

    prompts, outputs, concurrency = workload(args, "w1")
    engine_run(llm, [prompts[0][:16]], [4], 1, args.timeout)  # warm-up
    rows = []
    for cap in args.caps:
        set_cap(llm, cap)
        recs, wall = engine_run(llm, prompts, outputs, concurrency, args.timeout)
        rows.append({"cap": cap, "requests": len(prompts), "concurrency": concurrency,
                     "prompt": args.w1_prompt, "output": args.w1_output}
                    | summarize(recs, wall))
        r = rows[-1]
        say(f"cap sweep {cap}: {r['output_tok_s']:.1f} out tok/s, TTFT p50/p99 "
            f"{r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f} s, TPOT p50/p99 "
            f"{r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} ms, {r['errors']} errors")
    return rows


def hf_phase(args: argparse.Namespace, publish: Callable[[dict], dict]) -> None:
    from serve_ceilings import hf_generate, llm_kwargs

    say(f"hf generate: batch {args.w1_concurrency}, {args.w1_prompt} + {args.w1_output} tokens")
    result = hf_generate(llm_kwargs(serve_flags(args), args.chunk_policy), args.w1_concurrency,
                         args.w1_prompt, args.w1_output, args.seed + 1, args.hf_attn)
    publish({"hf_generate": {model_label(args): result}})
    say("hf generate: " + (f"skipped: {result['skipped']}" if "skipped" in result else
                           f"{result['output_tok_s']:.1f} out tok/s in {result['wall_s']:.1f} s"))


# ---------------------------------------------------------------- where it ran
def model_label(args: argparse.Namespace) -> str:
    """--label, else --model-config for dummy weights, else the model file's stem."""
    if args.label:
        return args.label
    if args.load_format == "dummy":
        return args.model_config or "gemma3-1b"
    from muser.loading.default_model import DEFAULT_MODEL_NAME

    return Path(args.model or DEFAULT_MODEL_NAME).stem


@functools.cache
def gpu_info() -> dict | None:
    """GPU 0 as nvidia-smi sees it (no CUDA context in this process); None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
                       check=False)
    if r.returncode != 0 or not r.stdout.strip():
        return None
    name, memory, driver = (x.strip() for x in r.stdout.splitlines()[0].split(","))
    return {"name": name, "memory": memory, "driver": driver}


def machine_info() -> dict:
    import torch

    from muser.bench import _cpu_model

    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def use_tokenizer_standin(path: Path) -> None:
    """A package named like the embedded model's holding only `path` (dummy weights read only
    its tokenizer), first on this process's path and on the server's PYTHONPATH."""
    from startup_h200 import standin_package

    site = str(standin_package(path, Path(tempfile.mkdtemp()) / "standin"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get(
        "PYTHONPATH")]))
    sys.path.insert(0, site)  # NOTE: the in-process phases import the package by name


# ---------------------------------------------------------------- command line
def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_n, hi_n = int(lo), int(hi or lo)
    if not 1 <= lo_n <= hi_n:
        raise argparse.ArgumentTypeError(f"want MIN:MAX with 1 <= MIN <= MAX, got {text}")
    return lo_n, hi_n


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def variants(text: str, kv_host_gb: float) -> list[tuple[str, tuple[str, ...]]]:
    """'off,on,NAME=FLAGS,...' -> (name, serve flags) per entry: a name of VARIANTS, or a name
    with its own flags."""
    out = []
    for entry in filter(None, text.split(",")):
        name, _, flags = entry.partition("=")
        if not flags and name not in VARIANTS:
            raise argparse.ArgumentTypeError(f"unknown variant {name!r}: one of "
                                             f"{', '.join(VARIANTS)}, or NAME=FLAGS")
        flags = flags or VARIANTS[name].format(kv_host_gb=kv_host_gb)
        out.append((name, tuple(shlex.split(flags))))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", default="w1,w2,adaptive", help="comma-separated of "
                   f"{', '.join(SERVED + IN_PROCESS)}, or none (default: %(default)s)")
    p.add_argument("--ceilings", action="store_true", help="= --phases " + ",".join(IN_PROCESS))
    p.add_argument("--label", help="the model's name in the receipt (default: --model-config "
                   "with dummy weights, else the model file's stem)")
    s = p.add_argument_group("muser serve flags, passed through only when given")
    for name, kind in SERVE_FLAGS:
        s.add_argument(f"--{name.replace('_', '-')}", type=kind)
    s.add_argument("--chunk-policy", choices=["adaptive", "fixed"], default="adaptive",
                   help="W1 and W2's server; adaptive runs on both (default: %(default)s)")
    w = p.add_argument_group("workloads")
    for name, value in (("w1-requests", 64), ("w1-concurrency", 32), ("w1-prompt", 512),
                        ("w1-output", 128), ("w2-requests", 256), ("w2-concurrency", 64),
                        ("adaptive-streams", 4), ("adaptive-prompt", 2000), ("seed", 0)):
        w.add_argument(f"--{name}", type=int, default=value, help="default: %(default)s")
    w.add_argument("--w2-prompt", type=span, default=(100, 1024), help="MIN:MAX (100:1024)")
    w.add_argument("--w2-output", type=span, default=(100, 512), help="MIN:MAX (100:512)")
    d = p.add_argument_group("W3 chat and W4 agent")
    for name, value in (("w3-conversations", 64), ("w3-turns", 6), ("w3-system", 2048),
                        ("w3-user", 256), ("w3-output", 128), ("w3-concurrency", 32),
                        ("w4-agents", 16), ("w4-steps", 12), ("w4-preamble", 6000),
                        ("w4-input", 400), ("w4-output", 64), ("w4-concurrency", 16)):
        d.add_argument(f"--{name}", type=int, default=value, help="default: %(default)s")
    d.add_argument("--w3-gap-s", type=float, default=1.0, help="mean idle seconds between a "
                   "conversation's turns, exponential (default: %(default)s)")
    d.add_argument("--w4-gap-s", type=float, default=0.25, help="mean idle seconds between an "
                   "agent's steps (its tool running), exponential (default: %(default)s)")
    named = "; ".join(f"{k} = {v.format(kv_host_gb='N')}" for k, v in VARIANTS.items())
    d.add_argument("--variants", default="off,on,fp8,host", help="servers W3 and W4 run on, "
                   f"comma-separated: {named}; or NAME=FLAGS (default: %(default)s)")
    d.add_argument("--kv-host-gb", type=float, default=32.0, help="the host variant's host "
                   "tier (default: %(default)s)")
    c = p.add_argument_group("in-process phases")
    c.add_argument("--decode-batches", type=ints, default=[1, 8, 32, 64], help="decode-only "
                   "batches, with each workload's, up to max_num_seqs (default: 1,8,32,64)")
    for name, value in (("ceiling-context", 512), ("ceiling-reps", 5), ("decode-steps", 20)):
        c.add_argument(f"--{name}", type=int, default=value, help="default: %(default)s")
    c.add_argument("--caps", type=ints, default=[64, 128, 256, 512], help="default: 64,...,512")
    c.add_argument("--hf-attn", default="sdpa", help="transformers attention (default: sdpa)")
    o = p.add_argument_group("bounds and output")
    o.add_argument("--timeout", type=float, default=600.0,
                   help="seconds for each request and each workload (default: %(default)s)")
    o.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds for the server to report ready (default: %(default)s)")
    o.add_argument("--clients", type=int, default=1, help="client processes for W1 and W2, "
                   "each sending every n-th request at 1/n of the concurrency (default: 1)")
    o.add_argument("--client-start-s", type=float, default=10.0, help="with --clients > 1: "
                   "seconds for the client processes to start before the first send (default: "
                   "%(default)s)")
    o.add_argument("--log-level", default="warning", help="the servers' (default: warning)")
    o.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "serve_bench",
                   help="folder for the servers' logs (default: %(default)s)")
    o.add_argument("--tokenizer-gguf", type=Path, help="stand-in for the embedded model "
                   "package where it is not installed (dummy weights read only its tokenizer)")
    o.add_argument("--out", type=Path, help="receipt JSON to create or merge into")
    o.add_argument("--plot", type=Path, help="PNG rendered from the receipt")
    args = p.parse_args(argv)
    args.phases = list(IN_PROCESS) if args.ceilings else [
        x for x in args.phases.split(",") if x and x != "none"]
    unknown = sorted(set(args.phases) - set(SERVED + IN_PROCESS))
    if unknown:
        p.error(f"unknown phases: {', '.join(unknown)}")
    try:
        args.variants = variants(args.variants, args.kv_host_gb)
    except argparse.ArgumentTypeError as exc:
        p.error(f"--variants: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokenizer_gguf:
        use_tokenizer_standin(args.tokenizer_gguf)
    receipt = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}
    where = {"machine": machine_info(), "gpu": gpu_info()}

    def publish(part: dict) -> dict:
        nonlocal receipt
        receipt = merge(receipt, where | part)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(receipt, indent=1) + "\n")
        return receipt

    say(f"phases {','.join(args.phases) or 'none'} for {model_label(args)}, serve flags: "
        f"{' '.join(serve_flags(args)) or '(defaults)'}")
    if set(SERVED) & set(args.phases):
        served_phases(args, publish)
    if {"ceilings", "cap-sweep"} & set(args.phases):
        llm_phases(args, publish)
    if "hf" in args.phases:
        hf_phase(args, publish)
    if args.phases or not receipt:  # NOTE: a plot-only run keeps where the receipt was made
        publish({})
    if args.plot:
        plot(receipt, args.plot)
        say(f"plot: {args.plot}")
    for cell in receipt.get("cells", []):
        say(cell_line(cell))
    say(f"done: {len(receipt.get('cells', []))} cells in {args.out or '(no --out)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
