"""Bounded loopback load test of `muser serve`: throughput, TTFT, TPOT, and the chunk policy.

Starts its own server on a free 127.0.0.1 port, sends a fixed number of requests, stops itself.

    python bench/load.py --out bench/results/serving.json --plot bench/results/serving.png

Phase 1 (adaptive server): --requests streamed completions, --concurrency at a time.
Phase 2 (adaptive, then a --chunk-policy fixed server): 4 streams are decoding when a
--long-prompt-token prompt arrives; the streams' inter-token gaps while it prefills are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from muser.config import default_dtypes
from muser.llm import default_device

KEY = "bench-key"
WORDS = ["river", "stone", "light", "window", "garden", "music", "paper", "winter", "market",
         "bridge", "silver", "cloud", "engine", "forest", "letter", "morning", "ocean", "story",
         "table", "voice"]


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] if s else float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(args: argparse.Namespace, policy: str):
    port = _free_port()
    cmd = [sys.executable, "-m", "muser", "serve", "--port", str(port), "--api-key", KEY,
           "--max-num-seqs", "8", "--max-model-len", "4096", "--chunk-policy", policy,
           "--log-level", "warning"] + (["--device", args.device] if args.device else []) + (
           ["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(120)


async def stream(client: httpx.AsyncClient, prompt: str | list[int], max_tokens: int,
                 stamps: list[float] | None = None) -> dict:
    """One streamed /v1/completions request -> {ttft, tpot, tokens, stamps}; stamps fill live."""
    stamps = [] if stamps is None else stamps
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": stamps[0] - start, "tpot": sum(gaps) / len(gaps) if gaps else None,
            "tokens": len(stamps), "start": start, "stamps": stamps}


async def throughput(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompts = [" ".join(rng.choices(WORDS, k=rng.randint(20, 200))) for _ in range(args.requests)]
    sem = asyncio.Semaphore(args.concurrency)
    errors = 0

    async def one(client: httpx.AsyncClient, prompt: str) -> dict | None:
        nonlocal errors
        async with sem:
            try:
                return await stream(client, prompt, args.max_tokens)
            except httpx.HTTPError:
                errors += 1
                return None

    async with httpx.AsyncClient(base_url=url, headers={"X-Api-Key": KEY}, timeout=600) as c:
        await stream(c, "warm up", 4)
        start = time.perf_counter()
        results = [r for r in await asyncio.gather(*(one(c, p) for p in prompts)) if r]
        wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    out_tokens = sum(r["tokens"] for r in results)
    return {"requests": args.requests, "concurrency": args.concurrency, "errors": errors,
            "completed": len(results), "max_tokens": args.max_tokens, "wall_s": wall,
            "output_tokens_per_s": out_tokens / wall, "requests_per_s": len(results) / wall,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99)}


async def long_prompt_arrives(url: str, args: argparse.Namespace) -> dict:
    """4 streams decode; a long prompt arrives; their gaps during its prefill are the result."""
    async with httpx.AsyncClient(base_url=url, headers={"X-Api-Key": KEY}, timeout=600) as c:
        text = " ".join(random.Random(1).choices(WORDS, k=args.long_prompt_tokens * 2))
        ids = (await c.post("/tokenize", json={"content": text, "add_special": True})
               ).json()["tokens"][:args.long_prompt_tokens]
        await stream(c, "warm up", 4)
        stamps: list[list[float]] = [[] for _ in range(4)]
        streams = [asyncio.create_task(stream(c, f"Stream {i}: tell a story.", 4000, stamps[i]))
                   for i in range(4)]
        while min(len(s) for s in stamps) < 3:
            await asyncio.sleep(0.01)
        long = await stream(c, ids, 1)
        arrive, done = long["start"], long["stamps"][0]
        await asyncio.sleep(3 * (done - arrive) / max(1, len(stamps[0])) + 1)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    gaps = [(b, b - a) for s in stamps for a, b in itertools.pairwise(s) if arrive < b <= done]
    return {"long_prompt_tokens": len(ids), "long_prompt_ttft_s": done - arrive,
            "stream_gaps_during_prefill": len(gaps),
            "tpot_p50_s": _pct([g for _, g in gaps], 50),
            "tpot_p99_s": _pct([g for _, g in gaps], 99),
            "tpot_max_s": max(g for _, g in gaps),
            "trace": {"arrive": arrive, "done": done,
                      "stamps": [[t - arrive for t in s] for s in stamps]}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = result["policy"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    for name, color in (("adaptive", "tab:blue"), ("fixed", "tab:red")):
        trace = policies[name]["trace"]
        for k, s in enumerate(trace["stamps"]):
            gaps = [b - a for a, b in itertools.pairwise(s)]
            axes[0].plot(s[1:], gaps, ".", color=color, ms=3,
                         label=f"{name} 512→64" if name == "adaptive" and k == 0 else
                         "fixed 512" if k == 0 else None)
        axes[0].axvspan(0, trace["done"] - trace["arrive"], color=color, alpha=0.08)
    axes[0].set(xlabel="seconds since the long prompt arrived", ylabel="inter-token gap (s)",
                title=f"4 decoding streams while a {policies['adaptive']['long_prompt_tokens']}"
                "-token prompt prefills (shaded)")
    axes[0].set_xlim(-2, None)
    axes[0].legend()
    names = ["adaptive", "fixed"]
    p50 = [policies[n]["tpot_p50_s"] for n in names]
    p99 = [policies[n]["tpot_p99_s"] for n in names]
    xs = range(len(names))
    axes[1].bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    axes[1].bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    axes[1].set_xticks(list(xs), ["adaptive\n512→64", "fixed\n512"])
    axes[1].set(ylabel="TPOT during prefill (s)", title="stream TPOT")
    axes[1].legend()
    fig.suptitle(f"muser serve on {result['device']}: {result['load']['output_tokens_per_s']:.1f} "
                 f"tok/s out at concurrency {result['load']['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--device")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long-prompt-tokens", type=int, default=2000)
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    result: dict = {"device": args.device or "default", "cpu_count": os.cpu_count(),
                    "machine": platform.machine(), "python": platform.python_version(),
                    "model": args.model or "embedded Gemma 3 270M Q4_K_M",
                    "dtype": default_dtypes(args.device or default_device())[0],
                    "max_num_seqs": 8, "max_model_len": 4096, "prefill_chunk": 512,
                    "decode_waiting_chunk": {"adaptive": 64, "fixed": 512}, "policy": {}}
    with serve(args, "adaptive") as url:
        result["load"] = asyncio.run(throughput(url, args))
        result["policy"]["adaptive"] = asyncio.run(long_prompt_arrives(url, args))
    with serve(args, "fixed") as url:
        result["policy"]["fixed"] = asyncio.run(long_prompt_arrives(url, args))
    load, pol = result["load"], result["policy"]
    print(f"load: {load['completed']}/{load['requests']} ok, {load['errors']} errors, "
          f"{load['output_tokens_per_s']:.1f} tok/s, TTFT p50/p99 {load['ttft_p50_s']:.3f}/"
          f"{load['ttft_p99_s']:.3f} s, TPOT p50/p99 {load['tpot_p50_s']:.3f}/"
          f"{load['tpot_p99_s']:.3f} s | 4-stream TPOT p99 during a "
          f"{pol['adaptive']['long_prompt_tokens']}-token prefill: adaptive "
          f"{pol['adaptive']['tpot_p99_s']:.3f} s vs fixed {pol['fixed']['tpot_p99_s']:.3f} s")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
