"""Disaggregated prefill, measured: TTFT with local prefill against a prefill worker's, the wire,
and running streams' gaps while long prompts arrive, colocated against disaggregated.

    python bench/disagg_bench.py --out bench/results/disagg_cpu.json --plot R.png
    python bench/disagg_bench.py --worker-device cuda --load-format dummy \
        --model-config gemma3-270m --out bench/results/disagg_h200.json      # the seed's setup

Bounded and one host only: it starts one `muser prefill-worker` on a free loopback port (on
--worker-device), builds the serving node's engine in this process (--device), and stops the
worker when done. Per prompt length (--lengths; by default up to the longest the context
allows): the TTFT of a --reps exact-token run (max_tokens=1, greedy) through the engine with
local prefill and with every prompt sent to the worker, median of each (the seed's method);
the wire bytes, bytes per token and transfer seconds of the remote runs. Then --streams
streams decode while --arrivals prompts of --arrival-tokens arrive one after another: their
inter-token gaps p50/p99, colocated and disaggregated. When the two sides differ in backend
or dtype, the first --check-steps greedy tokens of one prompt are compared, and the logit
difference of its first token.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_flags(args: argparse.Namespace) -> list[str]:
    if args.load_format == "dummy":
        return ["--load-format", "dummy", "--model-config", args.model_config]
    return ["--model", args.model] if args.model else []


def start_worker(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "muser", "prefill-worker", "--listen", address,
           "--device", args.worker_device, "--backend", args.backend,
           "--max-model-len", str(args.max_model_len),
           "--log-level", "info", *model_flags(args)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + args.start_timeout
    while "prefill worker ready" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the worker did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, address


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(31 * i + 7 * salt) % 5000 + 10 for i in range(n)]


def ttft_s(llm, ids: list[int]) -> float:
    from muser import SamplingParams

    return llm.generate(ids, SamplingParams(max_tokens=1)).ttft_s


def ttft_cells(llm, remote, args: argparse.Namespace, lengths: list[int]) -> list[dict]:
    cells = []
    for n in lengths:
        ids = prompt(n)
        llm.engine.remote = None
        local = [ttft_s(llm, ids) for _ in range(args.reps)]
        llm.engine.remote = remote
        before = remote.stats()
        far = [ttft_s(llm, ids) for _ in range(args.reps)]
        after = remote.stats()
        llm.engine.remote = None
        sent = after["outcomes"]["remote"] - before["outcomes"]["remote"]
        wire = (after["bytes"]["sum"] - before["bytes"]["sum"]) / max(1, sent)
        transfer = (after["seconds"]["sum"] - before["seconds"]["sum"]) / max(1, sent)
        cell = {"model": label(args), "prompt_tokens": n, "reps": args.reps,
                "ttft_local_s": statistics.median(local), "ttft_remote_s": statistics.median(far),
                "ttft_local_samples_s": local, "ttft_remote_samples_s": far,
                "remote_requests": sent, "wire_bytes": wire, "wire_bytes_per_token": wire / n,
                "transfer_s": transfer}
        cell["ttft_speedup"] = cell["ttft_local_s"] / cell["ttft_remote_s"]
        say(f"{n} tokens: TTFT local {cell['ttft_local_s']:.3f} s, remote "
            f"{cell['ttft_remote_s']:.3f} s ({cell['ttft_speedup']:.2f}x), {wire / 1e6:.1f} MB, "
            f"transfer {transfer:.3f} s, {sent}/{args.reps} remote")
        cells.append(cell)
    return cells


def stream_gaps(llm, remote, args: argparse.Namespace) -> dict:
    """--streams streams decode while --arrivals long prompts arrive one after another ->
    their inter-token gaps (ms) p50 / p99 / max while any of those prompts is in flight."""
    from muser import SamplingParams

    engine = llm.engine
    engine.remote = remote
    streams = [engine.add_request(prompt(32, i), SamplingParams(
        max_tokens=10_000, ignore_eos=True)).uid for i in range(args.streams)]
    last: dict[int, float] = {}
    gaps: list[float] = []
    arrivals, arrived = [], 0
    try:
        while len(last) < len(streams):  # every stream decoding
            for out in engine.step():
                last[out.uid] = time.perf_counter()
        pending: set[int] = set()
        while arrived < args.arrivals or pending:
            if not pending and arrived < args.arrivals:
                req = engine.add_request(prompt(args.arrival_tokens, 100 + arrived),
                                         SamplingParams(max_tokens=1))
                pending.add(req.uid)
                arrivals.append(time.perf_counter())
                arrived += 1
            for out in engine.step():
                now = time.perf_counter()
                if out.uid in last:
                    gaps.append((now - last[out.uid]) * 1e3)
                    last[out.uid] = now
                if out.finished:
                    pending.discard(out.uid)
            if not engine.has_work:
                time.sleep(0.0005)  # NOTE: only remote prefills in flight and no stream left
    finally:
        for uid in streams:
            engine.abort(uid)
        engine.remote = None
    gaps.sort()
    return {"streams": args.streams, "arrivals": args.arrivals,
            "arrival_tokens": args.arrival_tokens, "gaps": len(gaps),
            "gap_p50_ms": gaps[len(gaps) // 2], "gap_p99_ms": gaps[int(len(gaps) * 0.99)],
            "gap_max_ms": gaps[-1]}


def cross_check(llm, remote, args: argparse.Namespace) -> dict:
    """Greedy tokens and first-token logits of one prompt, local against remote prefill."""
    from muser import SamplingParams
    from muser.disagg.worker import prefill

    ids = prompt(min(2048, args.max_model_len // 2), 9)
    greedy = SamplingParams(max_tokens=args.check_steps, ignore_eos=True)
    near = prefill(llm, ids).logits
    far = remote._workers[0].transfer(-2, ids).snapshot.logits.to(near)
    local = llm.generate(ids, greedy).token_ids
    llm.engine.remote = remote
    served = llm.generate(ids, greedy).token_ids
    llm.engine.remote = None
    first = next((i for i, (a, b) in enumerate(zip(local, served)) if a != b), None)
    return {"prompt_tokens": len(ids), "steps": args.check_steps,
            "tokens_match": sum(a == b for a, b in zip(local, served)),
            "first_divergence": first,
            "first_token_logit_max_abs_diff": float((near - far).abs().max()),
            "first_token_argmax_equal": int(near.argmax()) == int(far.argmax())}


def write(receipt: dict, path: Path) -> None:
    path.write_text(json.dumps(receipt, indent=1) + "\n")


def label(args: argparse.Namespace) -> str:
    return args.model_config if args.load_format == "dummy" else Path(
        args.model or "gemma-3-270m-q4_k_m.gguf").stem


def plot(receipt: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = receipt["cells"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    n = [c["prompt_tokens"] for c in cells]
    a.plot(n, [c["ttft_local_s"] for c in cells], "o-", label=f"local ({receipt['device']})")
    a.plot(n, [c["ttft_remote_s"] for c in cells], "s-",
           label=f"remote ({receipt['worker_device']} worker)")
    a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (s)",
          title="TTFT, median of exact-token reps")
    a.legend()
    g = receipt["stream_gaps"]
    kinds = ["colocated", "disaggregated"]
    x = range(len(kinds))
    b.bar([i - 0.2 for i in x], [g[k]["gap_p50_ms"] for k in kinds], 0.4, label="p50")
    b.bar([i + 0.2 for i in x], [g[k]["gap_p99_ms"] for k in kinds], 0.4, label="p99")
    b.set_xticks(list(x), kinds)
    b.set(ylabel="inter-token gap (ms)",
          title=f"{g['colocated']['streams']} streams while "
                f"{g['colocated']['arrival_tokens']}-token prompts arrive")
    b.legend()
    fig.suptitle(f"disaggregated prefill: {receipt['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF (default: the embedded model)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--model-config", default="gemma3-270m")
    p.add_argument("--device", default="cpu", help="the serving node's (default: cpu)")
    p.add_argument("--worker-device", default="cpu", help="the worker's (default: cpu)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="the transport (nccl: --device and --worker-device two GPUs, e.g. "
                   "cuda:1 and cuda:0)")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                   default=[512, 2048, 8192], help="prompt lengths (default: 512,2048,8192)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--arrivals", type=int, default=2)
    p.add_argument("--arrival-tokens", type=int, default=2048)
    p.add_argument("--check-steps", type=int, default=16)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("muser.disagg").setLevel(logging.INFO)  # the crossover's timings

    from muser import LLM
    from muser.disagg.client import attach, crossover

    log = Path(tempfile.mkdtemp()) / "worker.log"
    worker, address = start_worker(args, log)
    try:
        # NOTE: dummy weights drawn where the worker draws them, so both hold the same values
        kwargs = {"load_format": "dummy", "model_config": args.model_config,
                  "dummy_made_on": torch.device(args.worker_device).type
                  } if args.load_format == "dummy" else {}
        # NOTE: no prefix reuse here: every rep must prefill its whole prompt
        llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len,
                  progress=False, prefix_cache=False, **kwargs)
        remote = attach(llm, [address], 1, 600.0, args.backend)
        llm.engine.remote = None
        lengths = [n for n in args.lengths if n < llm.config.max_model_len]
        receipt = {"model": label(args), "device": args.device, "worker_device": args.worker_device,
                   "transport": "gloo over loopback TCP" if args.backend == "gloo" else
                   "NCCL between two GPUs", "kv_dtype": llm.config.kv_dtype,
                   "machine": {"cpu": platform.processor() or platform.machine(),
                               "cores": os.cpu_count(), "torch": torch.__version__},
                   "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                   "cells": []}
        receipt["crossover_tokens"] = crossover(llm, remote)  # what `--disagg-min-tokens auto` picks
        say(f"crossover: {receipt['crossover_tokens']} tokens")
        for n in lengths:  # NOTE: the receipt is rewritten after each phase (a bounded run keeps them)
            receipt["cells"] += ttft_cells(llm, remote, args, [n])
            write(receipt, args.out)
        receipt["stream_gaps"] = {"colocated": stream_gaps(llm, None, args),
                                  "disaggregated": stream_gaps(llm, remote, args)}
        for kind, g in receipt["stream_gaps"].items():
            say(f"stream gaps {kind}: p50/p99/max {g['gap_p50_ms']:.1f}/{g['gap_p99_ms']:.1f}/"
                f"{g['gap_max_ms']:.1f} ms over {g['gaps']} gaps")
        write(receipt, args.out)
        receipt["cross_check"] = cross_check(llm, remote, args)
        say(f"cross check: {receipt['cross_check']}")
    finally:
        worker.kill()
        worker.wait(30)
    write(receipt, args.out)
    if args.plot:
        plot(receipt, args.plot)
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
