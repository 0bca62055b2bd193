"""Weight formats side by side on one GPU: decode after 2,048 tokens and prefill of 2,048, for
bf16 and FP8 (dummy weights of the preset) and GGUF files kept as blocks (Q8_0, Q4_K, ...),
each against its own bandwidth floor, and llama.cpp CUDA on the same GGUF files in the same
run.

    python3 bench/quant_bench.py --model-config gemma3-27b \
        --gguf q8_0=/dev/shm/gemma3-27b-q8_0.gguf,q4_k_m=/dev/shm/gemma3-27b-q4_k_m.gguf \
        --llama-bench /tmp/llama/bin/llama-bench --out $OUT/quant_h200.json --plot $OUT/quant.png

Per format, one process: `LLM` with one sequence, --reps runs of `generate` over 2,048 exact
tokens with --decode-steps + 1 greedy tokens (ignore_eos): prefill_tok_s = 2,048 / median
TTFT (in chunks of the engine's default --prefill-chunk, or the flag's), decode_ms = median
TPOT (with decode_ahead, the engine's default: on where decode steps replay CUDA graphs;
decode_ms_ahead_off / _on: the same runs the other way, in the same process);
decode_graph_ms = one decode step's CUDA graph replayed back to back (the GPU's time,
host_ms_per_step the rest of decode_ms); decode_intervals_ms = each token's interval in one run
of 5 x --decode-steps tokens after the same prompt, decode_steady_ms their median after the
first --decode-steps, sm_clock_samples = (ms from the first token, SM MHz, W) read through NVML
beside that run (after a prefill at the power limit the SM clock is low for the first ~100 ms of
decode: decode_ms includes that, as llama-bench's tg after its prefill does), and
decode_sm_mhz_median / decode_power_w_median the samples' medians over that run's decode.
fraction_of_floor = (the bytes a decode step reads: every projection's weights and the head
once, the embedding row, the K/V rows of 2,048 tokens on full layers and of the window on
sliding ones) / the 1 GiB device copy's bandwidth measured in that process (read + write) /
decode_ms. The FP8 process also times the GEMMs of one
layer at 2,048 rows on FP8 tensor cores (torch._scaled_mm on codes already quantized,
accumulated as the route accumulates, linear_fp8.FAST_ACCUM; gemm_shapes holds both ways) and
in bf16 (torch.mm): fp8_gemm_ceiling_tok_s = 2,048 / (layers x that layer's FP8 GEMM time),
the most any FP8 prefill could reach with its GEMMs alone. llama.cpp: `llama-bench -ngl 99 -fa 1`,
tg of --decode-steps tokens at depth 2,048 and pp2048, --reps runs, on each --gguf file.
--profile-decode STEPS: each cell also gets the kernels of STEPS decode steps after 2,048
tokens (GPU time per step by kernel, torch.profiler; with programmatic dependent launch a
kernel's time includes its wait on the one before, --no-pdl shows them apart), and what
each kernel adds to the step's time (`critical_us_per_step`: how far its end lies past the
latest end before it; `idle_us_per_step`: the GPU waiting on the host).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, threading, time
import torch
from muser import LLM, SamplingParams
import triton
from muser.graph.weights import matrix_tensors
from muser.ops.triton import linear_fp8, switches

name, fmt, source, reps, steps, depth, profile_steps, chunk, pdl = sys.argv[1:10]
switches.switched(pdl=pdl == "on").__enter__()  # NOTE: for the whole process (--no-pdl)
reps, steps, depth, profile_steps = int(reps), int(steps), int(depth), int(profile_steps)
steady_steps = 5 * steps


def cuda_ms(fn, iters=20):
    fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


x = torch.empty(2**30, device="cuda", dtype=torch.uint8)
y = torch.empty_like(x)
copy_bw = 2 * x.nbytes / (cuda_ms(lambda: y.copy_(x)) / 1e3)
del x, y
kw = dict(max_num_seqs=1, max_model_len=depth + steady_steps + 64, prefix_cache=False,
          progress=False, prefill_chunk=int(chunk) or None)
if fmt in ("bf16", "fp8"):
    llm = LLM(None, device="cuda", load_format="dummy", model_config=name,
              quantization="fp8" if fmt == "fp8" else "none", **kw)
else:
    llm = LLM(source, device="cuda", **kw)
cfg, w = llm.model_config, llm.runner.model.weights
held = w.nbytes()
head = {id(t) for t in matrix_tensors(w.head)}
embed_bytes = sum(t.nbytes for t in matrix_tensors(w.embed) if id(t) not in head)  # a row read
pool = llm.runner.pool  # NOTE: a row as the pool holds it (an FP8 cache packs its scales in)
row_bytes = 2 * cfg.num_kv_heads * pool.pages.shape[-1] * pool.pages.element_size()
n_full, n_sliding = len(cfg.layers_of("global")), len(cfg.layers_of("sliding"))
step_bytes = held - embed_bytes + row_bytes * (n_full * depth + n_sliding * min(depth, cfg.sliding_window))
ids = torch.randint(10, cfg.vocab_size - 10, (depth,),
                    generator=torch.Generator().manual_seed(1)).tolist()
greedy = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
llm.generate(ids[:512], greedy)
runs = [llm.generate(ids, greedy) for _ in range(reps)]
ttft = statistics.median(r.ttft_s for r in runs)
tpot = statistics.median(r.tpot_s for r in runs)
ahead = llm.engine.decode_ahead
llm.engine.decode_ahead = not ahead  # the same runs the other way, side by side
other = [llm.generate(ids, greedy) for _ in range(reps)]
llm.engine.decode_ahead = ahead
cell = {"model": name, "quantization": fmt, "source": source, "weight_bytes": held,
        "step_bytes": step_bytes, "decode_ms": tpot * 1e3, "floor_ms": step_bytes / copy_bw * 1e3,
        "fraction_of_floor": step_bytes / copy_bw / tpot, "prefill_tok_s": depth / ttft,
        "prefill_chunk": llm.config.prefill_chunk,
        "ttft_s": ttft, "decode_samples_ms": [r.tpot_s * 1e3 for r in runs],
        "ttft_samples_s": [r.ttft_s for r in runs], "copy_bytes_per_s": copy_bw,
        "tokens": runs[-1].token_ids[:16], "decode_ahead": ahead,
        "decode_ms_ahead_" + ("off" if ahead else "on"): statistics.median(
            r.tpot_s for r in other) * 1e3,
        "same_tokens_ahead_on_and_off": all(r.token_ids == runs[0].token_ids
                                            for r in runs + other),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__}
# One longer run, token by token: when each token reached the host, and the GPU's SM clock
# (NVML, where the process can read it) sampled beside it: after a prefill at the power limit
# the clock comes back up over the first ~100 ms of decode (docs/gpu-notes.md)
stamps, clocks, done = [], [], threading.Event()


def sample_clocks():
    while not done.is_set():
        clocks.append((time.perf_counter(), torch.cuda.clock_rate(), torch.cuda.power_draw()))
        time.sleep(0.02)


try:
    torch.cuda.clock_rate()
    sampler = threading.Thread(target=sample_clocks)
except Exception:  # noqa: BLE001  (no NVML: no clock samples)
    sampler = None
engine = llm.engine
engine.add_request(ids, SamplingParams(max_tokens=steady_steps + 1, ignore_eos=True))
if sampler is not None:
    sampler.start()
while engine.has_work:
    if engine.step():
        stamps.append(time.perf_counter())
done.set()
if sampler is not None:
    sampler.join()
intervals = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
cell["decode_intervals_ms"] = [round(x, 3) for x in intervals]
cell["decode_steady_ms"] = statistics.median(intervals[steps:])
cell["sm_clock_samples"] = [(round((t - stamps[0]) * 1e3, 1), mhz, round(mw / 1e3))
                            for t, mhz, mw in clocks]
during = [(mhz, w) for t, mhz, w in cell["sm_clock_samples"]
          if 0 <= t <= (stamps[-1] - stamps[0]) * 1e3]
if during:  # at the board's power limit the SM clock gives way: a step's time follows it
    cell["decode_sm_mhz_median"] = statistics.median(mhz for mhz, _ in during)
    cell["decode_power_w_median"] = statistics.median(w for _, w in during)
graphs = llm.runner.graphs
if graphs is not None and 1 in graphs.graphs:  # the batch-1 decode graph, replayed back to back
    # NOTE: the same packed step each time (its new K/V row stored again at one position): the
    # GPU's time of a decode step with no host work between steps
    cell["decode_graph_ms"] = cuda_ms(graphs.graphs[1].replay, iters=50)
    cell["host_ms_per_step"] = cell["decode_ms"] - cell["decode_graph_ms"]
if fmt == "fp8":
    cell["decode_picks"] = {k: v for k, v in linear_fp8.choices().items()
                            if k.startswith("(1,")}
    layer = w.layers[0]
    fp8_ms = bf16_ms = 0.0
    shapes = []
    for mat in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
        m, k = mat.shape
        xq = torch.randn(depth, k, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.ones(depth, 1, device="cuda")
        mms = {fast: cuda_ms(lambda fast=fast: torch._scaled_mm(
            xq, mat.data.t(), scale_a=sa, scale_b=mat.scales[None, :], out_dtype=torch.bfloat16,
            use_fast_accum=fast)) for fast in (True, False)}
        f = mms[linear_fp8.FAST_ACCUM]  # as the route runs it
        xb, wb = torch.randn(depth, k, device="cuda", dtype=torch.bfloat16), \
            torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = cuda_ms(lambda: torch.mm(xb, wb.t()))
        shapes.append({"m": m, "k": k, "fp8_ms": f, "fp8_fast_accum_ms": mms[True],
                       "fp8_float32_accum_ms": mms[False], "bf16_ms": b,
                       "fp8_tflops": 2 * depth * m * k / f / 1e9,
                       "bf16_tflops": 2 * depth * m * k / b / 1e9})
        fp8_ms, bf16_ms = fp8_ms + f, bf16_ms + b
        del xb, wb
    layers = len(w.layers)
    cell["gemm_shapes"] = shapes
    cell["fp8_gemm_ceiling_tok_s"] = depth / (layers * fp8_ms / 1e3)
    cell["bf16_gemm_ceiling_tok_s"] = depth / (layers * bf16_ms / 1e3)
    cell["prefill_of_fp8_gemm_ceiling"] = cell["prefill_tok_s"] / cell["fp8_gemm_ceiling_tok_s"]
if profile_steps:  # the kernels of decode steps after `depth` tokens (CUDA graph replays)
    from torch.profiler import ProfilerActivity, profile

    runner = llm.runner
    seq = runner.allocate()
    token = int(runner.forward([seq], [ids])[0].argmax())
    for _ in range(3):
        token = int(runner.forward([seq], [[token]])[0].argmax())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profile_steps):
            token = int(runner.forward([seq], [[token]])[0].argmax())
        torch.cuda.synchronize()
    per_step = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            us, count = per_step.get(e.key[:70], (0.0, 0))
            per_step[e.key[:70]] = (us + e.self_device_time_total / profile_steps,
                                    count + e.count // profile_steps)
    # What each kernel adds to the step: how far its end lies past the latest end before it
    # (kernels overlap under PDL, so a kernel's own duration counts its wait for the one before)
    # and, where it starts after that end, the idle time before it
    adds, idle, last_end = {}, 0.0, None
    for e in sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start):
        start, end = e.time_range.start, e.time_range.end
        if last_end is None:
            last_end = start
        idle += max(0.0, start - last_end)
        adds[e.name[:70]] = adds.get(e.name[:70], 0.0) + max(0.0, end - max(start, last_end))
        last_end = max(last_end, end)
    runner.free(seq)
    cell["decode_profile"] = {
        "critical_us_per_step": {k: round(us / profile_steps, 1) for k, us in
                                 sorted(adds.items(), key=lambda kv: -kv[1])},
        "idle_us_per_step": round(idle / profile_steps, 1),
        "steps": profile_steps, "pdl": switches.current().pdl,
        "kernel_us_per_step": sum(us for us, _ in per_step.values()),
        "launches_per_step": sum(n for _, n in per_step.values()),
        "kernels": {k: [round(us, 1), n] for k, (us, n) in
                    sorted(per_step.items(), key=lambda kv: -kv[1][0])}}
print("RESULT " + json.dumps(cell))
"""


def llama_bench(binary: str, gguf: str, depth: int, reps: int, steps: int) -> dict:
    cell = {"gguf": gguf, "tool": "llama-bench -ngl 99 -fa 1"}
    for label, flags in (("tg", ["-p", "0", "-n", str(steps), "-d", str(depth)]),
                         (f"pp{depth}", ["-p", str(depth), "-n", "0"])):
        proc = subprocess.run([binary, "-m", gguf, "-ngl", "99", "-fa", "1", "-r", str(reps),
                               "-o", "json", *flags],
                              stdout=subprocess.PIPE, text=True, check=False)
        rows = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else []
        if rows:
            cell[f"{label}_tok_s"] = rows[0]["avg_ts"]
            cell[f"{label}_samples_tok_s"] = rows[0].get("samples_ts")
        else:
            cell[f"{label}_error"] = f"exit {proc.returncode}"
    if "tg_tok_s" in cell:
        cell["decode_ms"] = 1e3 / cell["tg_tok_s"]
    print(f"llama.cpp {gguf}: {cell}", file=sys.stderr, flush=True)
    return cell


def plot(receipt: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = receipt["cells"]
    names = [c["quantization"] for c in cells]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    at = range(len(cells))
    left.bar([i - 0.27 for i in at], [c["decode_ms"] for c in cells], 0.27, label="muser")
    left.bar(at, [c["floor_ms"] for c in cells], 0.27, label="bandwidth floor", color="gray")
    left.bar([i + 0.27 for i in at], [c.get("llama_cpp_decode_ms") or 0 for c in cells], 0.27,
             label="llama.cpp")
    left.set_ylabel("decode ms/token after 2,048")
    right.bar([i - 0.2 for i in at], [c["prefill_tok_s"] for c in cells], 0.4, label="muser")
    right.bar([i + 0.2 for i in at], [c.get("llama_cpp_prefill_tok_s") or 0 for c in cells],
              0.4, label="llama.cpp")
    right.set_ylabel("prefill tok/s of 2,048")
    for ax in (left, right):
        ax.set_xticks(list(at), names)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{receipt['model']} on {receipt.get('gpu', 'GPU')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="gemma3-27b")
    ap.add_argument("--formats", default="bf16,fp8", help="dummy-weight formats: bf16, fp8")
    ap.add_argument("--gguf", default="", help="name=path,... GGUF files kept as blocks")
    ap.add_argument("--llama-bench", help="a CUDA llama-bench binary, run on each --gguf file")
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="rows per prefill chunk (0: the engine's default)")
    ap.add_argument("--profile-decode", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS decode steps (kernel time per step, by kernel)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="programmatic dependent launch off (muser/ops/triton/switches.py)")
    args = ap.parse_args()
    receipt = json.loads(args.out.read_text()) if args.out.exists() else {"cells": []}
    receipt["model"] = args.model_config
    runs = [(f, "") for f in args.formats.split(",") if f] + [
        tuple(e.split("=", 1)) for e in args.gguf.split(",") if e]
    for fmt, source in runs:
        proc = subprocess.run([sys.executable, "-c", CHILD, args.model_config, fmt, source,
                               str(args.reps), str(args.decode_steps), str(args.depth),
                               str(args.profile_decode), str(args.prefill_chunk),
                               "off" if args.no_pdl else "on"],
                              stdout=subprocess.PIPE, text=True, check=False)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{fmt}: the process failed (exit {proc.returncode})", file=sys.stderr)
            continue
        cell = json.loads(line[7:])
        if args.llama_bench and source:
            theirs = llama_bench(args.llama_bench, source, args.depth, args.reps,
                                 args.decode_steps)
            cell["llama_cpp"] = theirs
            if "decode_ms" in theirs:
                cell["llama_cpp_decode_ms"] = theirs["decode_ms"]
                cell["decode_vs_llama_cpp"] = theirs["decode_ms"] / cell["decode_ms"]
            if f"pp{args.depth}_tok_s" in theirs:
                cell["llama_cpp_prefill_tok_s"] = theirs[f"pp{args.depth}_tok_s"]
                cell["prefill_vs_llama_cpp"] = cell["prefill_tok_s"] / theirs[f"pp{args.depth}_tok_s"]
        print(f"{fmt}: {json.dumps({k: v for k, v in cell.items() if not k.endswith('samples_ms')})}",
              file=sys.stderr, flush=True)
        receipt["cells"] = [c for c in receipt["cells"] if c["quantization"] != fmt] + [cell]
        receipt["gpu"] = cell["gpu"]
        args.out.write_text(json.dumps(receipt, indent=1) + "\n")
    bf16 = next((c for c in receipt["cells"] if c["quantization"] == "bf16"), None)
    for c in receipt["cells"]:
        if bf16 is not None:
            c["prefill_vs_bf16"] = c["prefill_tok_s"] / bf16["prefill_tok_s"]
            c["decode_vs_bf16"] = bf16["decode_ms"] / c["decode_ms"]
    args.out.write_text(json.dumps(receipt, indent=1) + "\n")
    if args.plot:
        plot(receipt, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
