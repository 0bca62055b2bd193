"""Disaggregated prefill, measured: TTFT with local prefill against a prefill worker's, the wire,
running streams' decode while long prompts arrive, and goodput under a request rate,
colocated against disaggregated.

    python bench/disagg_bench.py --out bench/results/disagg_cpu.json --plot R.png
    python bench/disagg_bench.py --device cpu --worker-device cuda --load-format dummy \
        --model-config gemma3-270m --out bench/results/disagg_h200.json      # the seed's setup
    python bench/disagg_bench.py --backend nccl --device cuda:1 --worker-device cuda:0 \
        --load-format dummy --model-config gemma3-27b --max-model-len 131072 \
        --lengths 2048,8192,32768,131008 --streams 16 --arrival-tokens 8192 \
        --arrival-rate 0.5 --goodput-rates 0.25,0.5,1,2 --out disagg_h200x2.json   # two GPUs

Bounded and one host only: it starts one `muser prefill-worker` on a free loopback port (on
--worker-device), builds the serving node's engine in this process (--device), and stops the
worker when done. Phases (--phases, in this order; the receipt is rewritten after each, and an
existing --out keeps the phases this run does not do, so one receipt can be filled over several
bounded calls):

- copy: the copy bandwidth between the two sides' devices (GPU to GPU over their link, or
  within the host's memory), the yardstick of the KV hand-off;
- ttft: per prompt length (--lengths; by default up to the longest the context allows), the
  TTFT of a --reps exact-token run (max_tokens=1, greedy) through the engine with local
  prefill (colocated) and with every prompt sent to the worker (disaggregated), median of each
  (the seed's method); the wire bytes, the round trip's seconds and the KV hand-off's (its
  tensors received), and the hand-off's rate against the copy bandwidth;
- interference: --streams streams decode alone (idle), then while --arrivals prompts of
  --arrival-tokens arrive (one after another, or at --arrival-rate a second): the streams'
  inter-token gaps p50/p99 (their TPOT), colocated and disaggregated, each against idle;
- goodput: for each of --goodput-rates, --goodput-requests requests of --goodput-tokens
  prompt tokens and --goodput-output new tokens arriving at that rate: the fraction meeting
  TTFT <= --slo-ttft-s and TPOT <= --slo-tpot-ms (attainment), and goodput = the rate times
  the attainment, colocated and disaggregated; `at_rate` names the lowest rate where
  colocated attainment falls below 0.9;
- check: when the two sides differ in backend or dtype, the first --check-steps greedy tokens
  of one prompt, local against remote, and the logit difference of its first token.
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
        local = [ttft_s(llm, ids) for _ in range(args.reps)]
        llm.engine.add_source(remote)
        before = remote.stats()
        far = [ttft_s(llm, ids) for _ in range(args.reps)]
        after = remote.stats()
        llm.engine.remove_source(remote)
        sent = after["outcomes"]["remote"] - before["outcomes"]["remote"]
        wire = (after["bytes"]["sum"] - before["bytes"]["sum"]) / max(1, sent)
        transfer = (after["seconds"]["sum"] - before["seconds"]["sum"]) / max(1, sent)
        handoff = (after["receive_s"] - before["receive_s"]) / max(1, sent)
        # NOTE: the same two medians under the disaggregated-prefill issue's names (local,
        # remote) and the two-GPU issue's (colocated, disagg): each one's receipts are read
        # by the scripts written for it
        cell = {"model": label(args), "prompt_tokens": n, "reps": args.reps,
                "ttft_local_s": statistics.median(local), "ttft_remote_s": statistics.median(far),
                "ttft_colocated_s": statistics.median(local),
                "ttft_disagg_s": statistics.median(far),
                "ttft_local_samples_s": local, "ttft_remote_samples_s": far,
                "remote_requests": sent, "wire_bytes": wire, "wire_bytes_per_token": wire / n,
                "transfer_s": transfer, "handoff_s": handoff,
                "handoff_gbps": wire / handoff / 1e9 if handoff else None}
        cell["ttft_speedup"] = cell["ttft_local_s"] / cell["ttft_remote_s"]
        if cell["handoff_gbps"] and args.copy_gbps:
            cell["handoff_of_copy"] = cell["handoff_gbps"] / args.copy_gbps
        say(f"{n} tokens: TTFT local {cell['ttft_local_s']:.3f} s, remote "
            f"{cell['ttft_remote_s']:.3f} s ({cell['ttft_speedup']:.2f}x), {wire / 1e6:.1f} MB, "
            f"round trip {transfer:.3f} s, hand-off {handoff:.4f} s, {sent}/{args.reps} remote")
        cells.append(cell)
    return cells


def stream_gaps(llm, remote, args: argparse.Namespace, arrivals: int | None = None) -> dict:
    """--streams streams decode while `arrivals` (default --arrivals) prompts of
    --arrival-tokens arrive, one after another or, with --arrival-rate, at that rate -> the
    streams' inter-token gaps (ms) p50 / p99 / max until the last prompt's first token. With
    no arrivals (idle): the gaps of --idle-steps steps of the streams alone."""
    from muser import SamplingParams

    arrivals = args.arrivals if arrivals is None else arrivals
    engine = llm.engine
    engine.add_source(remote)
    streams = [engine.add_request(prompt(32, i), SamplingParams(
        max_tokens=10_000, ignore_eos=True)).uid for i in range(args.streams)]
    last: dict[int, float] = {}
    gaps: list[float] = []
    arrived, steps = 0, 0
    try:
        while len(last) < len(streams):  # every stream decoding
            for out in engine.step():
                last[out.uid] = time.perf_counter()
        pending: set[int] = set()
        start = time.perf_counter()
        while arrived < arrivals or pending or (not arrivals and steps < args.idle_steps):
            due = (start + arrived / args.arrival_rate <= time.perf_counter()
                   if args.arrival_rate else not pending)
            if arrived < arrivals and due:
                req = engine.add_request(prompt(args.arrival_tokens, 100 + arrived),
                                         SamplingParams(max_tokens=1))
                pending.add(req.uid)
                arrived += 1
            for out in engine.step():
                now = time.perf_counter()
                if out.uid in last:
                    gaps.append((now - last[out.uid]) * 1e3)
                    last[out.uid] = now
                if out.finished:
                    pending.discard(out.uid)
            steps += 1
            if not engine.has_work:
                time.sleep(0.0005)  # NOTE: only remote prefills in flight and no stream left
    finally:
        for uid in streams:
            engine.abort(uid)
        engine.remove_source(remote)
    gaps.sort()
    return {"streams": args.streams, "arrivals": arrivals,
            "arrival_tokens": args.arrival_tokens if arrivals else None,
            "arrival_rate": (args.arrival_rate or None) if arrivals else None,
            "gaps": len(gaps), "gap_p50_ms": gaps[len(gaps) // 2],
            "gap_p99_ms": gaps[int(len(gaps) * 0.99)], "gap_max_ms": gaps[-1]}


def interference(llm, remote, args: argparse.Namespace) -> dict:
    """The streams idle, then colocated and disaggregated while prompts arrive; each of the
    two with its p99 against idle's."""
    out = {"idle": stream_gaps(llm, None, args, arrivals=0),
           "colocated": stream_gaps(llm, None, args),
           "disaggregated": stream_gaps(llm, remote, args)}
    for kind in ("colocated", "disaggregated"):
        out[kind]["p99_vs_idle_p99"] = out[kind]["gap_p99_ms"] / out["idle"]["gap_p99_ms"]
        out[kind]["p99_vs_idle_p50"] = out[kind]["gap_p99_ms"] / out["idle"]["gap_p50_ms"]
    for kind, g in out.items():
        say(f"stream gaps {kind}: p50/p99/max {g['gap_p50_ms']:.1f}/{g['gap_p99_ms']:.1f}/"
            f"{g['gap_max_ms']:.1f} ms over {g['gaps']} gaps")
    return out


def goodput_run(llm, remote, args: argparse.Namespace, rate: float) -> dict:
    """--goodput-requests requests arriving every 1 / rate s -> per request TTFT (first
    token - arrival) and TPOT (mean gap after it); attainment and goodput at the SLOs."""
    from muser import SamplingParams

    engine = llm.engine
    engine.add_source(remote)
    sampling = SamplingParams(max_tokens=args.goodput_output, ignore_eos=True)
    arrival: dict[int, float] = {}
    first: dict[int, float] = {}
    done: dict[int, tuple[float, int]] = {}
    count: dict[int, int] = {}
    start = time.perf_counter()
    try:
        while len(done) < args.goodput_requests:
            now = time.perf_counter()
            if len(arrival) < args.goodput_requests and start + len(arrival) / rate <= now:
                req = engine.add_request(prompt(args.goodput_tokens, 1000 + len(arrival)),
                                         sampling)
                arrival[req.uid] = now
            for out in engine.step():
                if out.uid not in arrival or out.token_id is None:
                    continue
                t = time.perf_counter()
                first.setdefault(out.uid, t)
                count[out.uid] = count.get(out.uid, 0) + 1
                if out.finished:
                    done[out.uid] = (t, count[out.uid])
            if not engine.has_work:
                time.sleep(0.0005)
    finally:
        for uid in set(arrival) - set(done):
            engine.abort(uid)
        engine.remove_source(remote)
    wall = max(t for t, _ in done.values()) - start
    ttft = {u: first[u] - arrival[u] for u in done}
    tpot = {u: (t - first[u]) / (n - 1) * 1e3 if n > 1 else 0.0 for u, (t, n) in done.items()}
    met = [u for u in done if ttft[u] <= args.slo_ttft_s and tpot[u] <= args.slo_tpot_ms]
    # NOTE: goodput at an offered rate = the rate times the fraction served within the SLOs
    # (met / wall would count a short run's drain as throughput)
    return {"rate": rate, "requests": len(done), "wall_s": wall,
            "attainment": len(met) / len(done), "goodput_rps": rate * len(met) / len(done),
            "ttft_p50_s": statistics.median(ttft.values()), "ttft_max_s": max(ttft.values()),
            "tpot_p50_ms": statistics.median(tpot.values()), "tpot_max_ms": max(tpot.values())}


def goodput(llm, remote, args: argparse.Namespace) -> dict:
    """goodput_run per rate, colocated and disaggregated, and the lowest rate where colocated
    attainment falls below 0.9 (`at_rate`: its cells side by side)."""
    out: dict = {"slo_ttft_s": args.slo_ttft_s, "slo_tpot_ms": args.slo_tpot_ms,
                 "prompt_tokens": args.goodput_tokens, "output_tokens": args.goodput_output,
                 "colocated": [], "disaggregated": []}
    for rate in args.goodput_rates:
        for kind, far in (("colocated", None), ("disaggregated", remote)):
            run = goodput_run(llm, far, args, rate)
            out[kind].append(run)
            say(f"goodput {kind} at {rate} req/s: attainment {run['attainment']:.2f}, "
                f"{run['goodput_rps']:.3f} req/s, TTFT p50 {run['ttft_p50_s']:.3f} s, "
                f"TPOT p50 {run['tpot_p50_ms']:.1f} ms")
    below = [i for i, r in enumerate(out["colocated"]) if r["attainment"] < 0.9]
    if below:
        i = below[0]
        near, far = out["colocated"][i], out["disaggregated"][i]
        out["at_rate"] = {"rate": near["rate"], "colocated_goodput_rps": near["goodput_rps"],
                          "disagg_goodput_rps": far["goodput_rps"],
                          "colocated_attainment": near["attainment"],
                          "disagg_attainment": far["attainment"]}
    return out


def copy_bandwidth(src: str, dst: str) -> dict:
    """Bytes a second of one copy of a 1 GiB buffer from src's device to dst's (GPU to GPU
    over their link, or within one device's memory), the best of 5 after a warm one."""
    a, b = torch.device(src), torch.device(dst)
    n = 1 << 30 if "cuda" in (a.type, b.type) else 1 << 28
    x = torch.empty(n, dtype=torch.uint8, device=a)
    y = torch.empty(n, dtype=torch.uint8, device=b)
    best = float("inf")
    for i in range(6):
        for d in {a, b}:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        y.copy_(x)
        for d in {a, b}:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        if i:
            best = min(best, time.perf_counter() - t0)
    return {"from": str(a), "to": str(b), "bytes": n, "gbps": n / best / 1e9}


def cross_check(llm, remote, args: argparse.Namespace) -> dict:
    """Greedy tokens and first-token logits of one prompt, local against remote prefill."""
    from muser import SamplingParams
    from muser.disagg.worker import prefill

    ids = prompt(min(2048, args.max_model_len // 2), 9)
    greedy = SamplingParams(max_tokens=args.check_steps, ignore_eos=True)
    near = prefill(llm, ids).logits
    far = remote._workers[0].transfer(-2, ids).snapshot.logits.to(near)
    local = llm.generate(ids, greedy).token_ids
    llm.engine.add_source(remote)
    served = llm.generate(ids, greedy).token_ids
    llm.engine.remove_source(remote)
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
    """TTFT per prompt length, the streams' gaps, goodput per rate: the phases measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("cells", "stream_gaps", "goodput") if receipt.get(k)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "cells":
            cells = receipt["cells"]
            n = [c["prompt_tokens"] for c in cells]
            ax.plot(n, [c["ttft_local_s"] for c in cells], "o-",
                    label=f"colocated ({receipt['device']})")
            ax.plot(n, [c["ttft_remote_s"] for c in cells], "s-",
                    label=f"disaggregated ({receipt['worker_device']} worker)")
            ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (s)",
                   title="TTFT, median of exact-token reps")
        elif panel == "stream_gaps":
            g = receipt["stream_gaps"]
            kinds = [k for k in ("idle", "colocated", "disaggregated") if k in g]
            x = range(len(kinds))
            ax.bar([i - 0.2 for i in x], [g[k]["gap_p50_ms"] for k in kinds], 0.4, label="p50")
            ax.bar([i + 0.2 for i in x], [g[k]["gap_p99_ms"] for k in kinds], 0.4, label="p99")
            ax.set_xticks(list(x), kinds)
            ax.set(ylabel="inter-token gap (ms)",
                   title=f"{g['colocated']['streams']} streams while "
                         f"{g['colocated']['arrival_tokens']}-token prompts arrive")
        else:
            g = receipt["goodput"]
            for kind, mark in (("colocated", "o-"), ("disaggregated", "s-")):
                runs = g[kind]
                ax.plot([r["rate"] for r in runs], [r["goodput_rps"] for r in runs], mark,
                        label=kind)
            ax.set(xlabel="request rate (1/s)", ylabel="requests meeting both SLOs (1/s)",
                   title=f"goodput: TTFT <= {g['slo_ttft_s']} s, TPOT <= {g['slo_tpot_ms']} ms")
        ax.legend()
    fig.suptitle(f"disaggregated prefill: {receipt['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PHASES = ("copy", "ttft", "interference", "goodput", "check")


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


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
    p.add_argument("--max-num-seqs", type=int, help="the serving node's (default: its device's)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"which to run, of {','.join(PHASES)} (default: all)")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                   default=[512, 2048, 8192], help="prompt lengths (default: 512,2048,8192)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--idle-steps", type=int, default=64,
                   help="decode steps of the streams alone (their idle TPOT)")
    p.add_argument("--arrivals", type=int, default=2)
    p.add_argument("--arrival-tokens", type=int, default=2048)
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="prompts a second (default 0: each after the one before has its token)")
    p.add_argument("--goodput-rates", type=floats, default=[0.5, 1.0, 2.0],
                   help="request rates (a second) of the goodput phase")
    p.add_argument("--goodput-requests", type=int, default=16)
    p.add_argument("--goodput-tokens", type=int, default=2048)
    p.add_argument("--goodput-output", type=int, default=64)
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--check-steps", type=int, default=16)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    phases = args.phases.split(",")
    if unknown := set(phases) - set(PHASES):
        p.error(f"unknown phases {sorted(unknown)}: choose from {', '.join(PHASES)}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("muser.disagg").setLevel(logging.INFO)  # the crossover's timings

    from muser import LLM
    from muser.disagg.client import attach, crossover

    receipt = json.loads(args.out.read_text()) if args.out.exists() else {}
    args.copy_gbps = receipt.get("copy", {}).get("gbps")
    if "copy" in phases:  # NOTE: first, while nothing else holds the devices
        receipt["copy"] = copy_bandwidth(args.worker_device, args.device)
        args.copy_gbps = receipt["copy"]["gbps"]
        say(f"copy {args.worker_device} -> {args.device}: {args.copy_gbps:.1f} GB/s")
    log = Path(tempfile.mkdtemp()) / "worker.log"
    worker, address = start_worker(args, log)
    try:
        # NOTE: dummy weights drawn where the worker draws them, so both hold the same values
        kwargs = {"load_format": "dummy", "model_config": args.model_config,
                  "dummy_made_on": torch.device(args.worker_device).type
                  } if args.load_format == "dummy" else {}
        if args.max_num_seqs:
            kwargs["max_num_seqs"] = args.max_num_seqs
        # NOTE: no prefix reuse here: every rep must prefill its whole prompt
        llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len,
                  progress=False, prefix_cache=False, **kwargs)
        remote = attach(llm, [address], 1, 600.0, args.backend)
        llm.engine.remove_source(remote)
        lengths = [n for n in args.lengths if n < llm.config.max_model_len]
        receipt |= {"model": label(args), "device": args.device,
                    "worker_device": args.worker_device,
                    "transport": "gloo over loopback TCP" if args.backend == "gloo" else
                    "NCCL between two GPUs", "kv_dtype": llm.config.kv_dtype,
                    "machine": {"cpu": platform.processor() or platform.machine(),
                                "cores": os.cpu_count(), "torch": torch.__version__},
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "max_num_seqs": llm.config.max_num_seqs}
        # what `--disagg-min-tokens auto` would pick
        receipt["crossover_tokens"] = crossover(llm, remote)
        say(f"crossover: {receipt['crossover_tokens']} tokens")
        if "ttft" in phases:  # NOTE: the receipt is rewritten after each length and phase
            receipt["cells"] = [c for c in receipt.get("cells", [])
                                if c["prompt_tokens"] not in lengths]
            for n in lengths:
                receipt["cells"] += ttft_cells(llm, remote, args, [n])
                receipt["cells"].sort(key=lambda c: c["prompt_tokens"])
                write(receipt, args.out)
        if "interference" in phases:
            receipt["stream_gaps"] = interference(llm, remote, args)
            write(receipt, args.out)
        if "goodput" in phases:
            receipt["goodput"] = goodput(llm, remote, args)
            write(receipt, args.out)
        if "check" in phases:
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
