"""Context depth: TTFT of a whole prompt, TPOT after it and 512 tokens appended at depth, for
one or more versions of muser side by side (each in its own process, one after another) and
llama.cpp on the same shape in the same run.

    python3 bench/depth_matrix.py --model-config gemma3-27b --depths 2048,8192,32768,131008 \
        --llama-bench /tmp/llama/bin/llama-bench --gguf /dev/shm/gemma3-27b-bf16.gguf \
        --out $OUT/depth_h200.json --plot $OUT/depth_h200.png      # the H200 run
    python3 bench/depth_matrix.py --versions base=.devcarry/ab_depth,head=. ...   # an A/B
    python3 bench/depth_matrix.py --device cpu --model-config gemma3-270m --llama-cpp-python \
        --depths 2048,8192,32768 --out bench/results/depth_cpu.json   # the embedded 270M

GPU: seeded dummy bf16 weights of the preset; with --llama-bench (bench/llama_cpp_cuda.sh
builds it; bench/synth_gguf.py writes the GGUF of the preset's shape) `llama-bench -ngl 99
-fa 1 -d DEPTH` per depth, --reps runs, decode of --decode-steps tokens (tg) and a 512-token
prompt appended at that depth (pp512). CPU: the GGUF (--model, default the embedded one) in
muser and, with --llama-cpp-python, in llama.cpp through llama-cpp-python, the same cells timed
the same way. Each version's cells gain llama_cpp_tpot_ms, decode_vs_llama_cpp (llama.cpp ms /
muser ms), chunk512_vs_llama_cpp (muser's median tok/s / the pp512 tok/s llama-bench reports,
the mean of its runs) and chunk512_vs_llama_cpp_median (against the median of its runs).

Per muser process: one sequence, the prefix cache off except for the appended chunk. Per depth:
--reps runs of `LLM.generate` over `depth` exact tokens with max_tokens = --decode-steps + 1
(greedy, ignore_eos): TTFT is the whole prompt's prefill and first token, TPOT the mean of the
decode steps after it; the median of each over the runs. Then --reps times a 512-token chunk
appended at that depth: the prompt of `depth` tokens once with the prefix cache on, then it
plus 512 new tokens, whose TTFT is the restore of the cached `depth` and the chunk's prefill.
fraction_of_floor = the step's bytes (every weight once, plus the K/V rows the step reads: the
prompt's on full layers, the window's on sliding layers) / the copy bandwidth measured in the
same process, / TPOT. The receipt is rewritten after each process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, statistics, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from muser import LLM, SamplingParams

name, depths, reps, steps = sys.argv[2], [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5])
device, model = sys.argv[6], (sys.argv[7] or None)
kv = {"kv_dtype": sys.argv[8]} if sys.argv[8] else {}
cuda = device == "cuda"
x = torch.empty(2**30 if cuda else 2**27, device=device, dtype=torch.bfloat16)
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
if cuda:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    b.synchronize()
    seconds = a.elapsed_time(b) / 1e3
else:
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    seconds = time.perf_counter() - t0
copy_bw = 2 * x.nbytes * 10 / seconds
del x, y
source = dict(load_format="dummy", model_config=name) if model is None else {}
llm = LLM(model, device=device, max_num_seqs=1, max_model_len=max(depths) + 512 + steps + 8,
          prefix_cache=True, progress=False, **source, **kv)
cache, llm.runner.prefix = llm.runner.prefix, None  # NOTE: on only for the appended chunk
cfg = llm.model_config
for depth in [d for d in depths if d + steps + 1 > llm.config.max_model_len]:
    print(f"{name}: depth {depth} skipped: the context holds {llm.config.max_model_len}",
          file=sys.stderr, flush=True)
depths = [d for d in depths if d + steps + 1 <= llm.config.max_model_len]
weight_bytes = llm.runner.model.weights.nbytes()
pool = llm.runner.pool  # NOTE: a row as the pool holds it (an FP8 cache packs its scales in)
row_bytes = 2 * cfg.num_kv_heads * pool.pages.shape[-1] * pool.pages.element_size()  # K and V
n_full, n_sliding = len(cfg.layers_of("global")), len(cfg.layers_of("sliding"))
ids = torch.randint(10, cfg.vocab_size - 10, (max(depths) + 512,),
                    generator=torch.Generator().manual_seed(1)).tolist()
greedy = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
llm.generate(ids[:512], greedy)  # warm-up
cells = []
for depth in depths:
    runs = [llm.generate(ids[:depth], greedy) for _ in range(reps)]
    ttft = statistics.median(r.ttft_s for r in runs)
    tpot = statistics.median(r.tpot_s for r in runs)
    # 512 new tokens after a cached prefix of `depth` (its restore + their prefill): the
    # prefix is computed once with the cache on; each run appends tokens of its own, so no run
    # finds another's tail cached
    # NOTE: past the context's end, the chunk is appended where it ends at the context's end
    at = min(depth, llm.config.max_model_len - 512 - 1)
    llm.runner.prefix = cache
    cache.reset(llm.runner.pages)
    first = SamplingParams(max_tokens=1)
    llm.generate(ids[:at], first)  # leaves its end checkpoint at `at`
    chunk = []
    for rep in range(reps):
        tail = torch.randint(10, cfg.vocab_size - 10, (512,),
                             generator=torch.Generator().manual_seed(100 + rep)).tolist()
        before = cache.stats().tokens_reused
        chunk.append(llm.generate(ids[:at] + tail, first).ttft_s)
        assert cache.stats().tokens_reused - before == at, "the prefix was not reused"
    cache.reset(llm.runner.pages)
    llm.runner.prefix = None
    step_bytes = weight_bytes + row_bytes * (n_full * depth + n_sliding * min(depth, cfg.sliding_window))
    cells.append({"model": name, "depth": depth, "kv_dtype": llm.config.kv_dtype, "reps": reps,
                  "ttft_s": ttft,
                  "tpot_ms": tpot * 1e3, "ttft_samples_s": [r.ttft_s for r in runs],
                  "tpot_samples_ms": [r.tpot_s * 1e3 for r in runs],
                  "prefill_tok_s": depth / ttft, "step_bytes": step_bytes,
                  "chunk512_depth": at, "chunk512_at_depth_s": statistics.median(chunk),
                  "chunk512_samples_s": chunk,
                  "chunk512_at_depth_tok_s": 512 / statistics.median(chunk),
                  "floor_ms": step_bytes / copy_bw * 1e3,
                  "fraction_of_floor": step_bytes / copy_bw / tpot})
    print(f"{name} depth {depth}: TTFT {ttft:.3f} s, TPOT {tpot * 1e3:.2f} ms "
          f"(floor {step_bytes / copy_bw * 1e3:.2f} ms)", file=sys.stderr, flush=True)
print("RESULT " + json.dumps({"copy_bytes_per_s": copy_bw, "weight_bytes": weight_bytes,
                              "device": torch.cuda.get_device_name() if cuda else "cpu",
                              "threads": torch.get_num_threads(), "torch": torch.__version__,
                              "weights": str(llm.path) if model else "dummy bf16",
                              "load_average_after": os.getloadavg(),
                              "cells": cells}))
"""


def llama_bench(binary: str, gguf: str, depths: list[int], reps: int, steps: int) -> list[dict]:
    """`llama-bench -d DEPTH -p 512 -n STEPS`, one process per depth: its tg and pp512 tests
    share the model load and the prompt of `depth` tokens (llama-bench fills it once and
    restores its state before every run)."""
    cells = []
    for depth in depths:
        cell = {"depth": depth}
        proc = subprocess.run([binary, "-m", gguf, "-ngl", "99", "-fa", "1", "-d", str(depth),
                               "-r", str(reps), "-o", "json", "-p", "512", "-n", str(steps)],
                              stdout=subprocess.PIPE, text=True, check=False)
        for row in json.loads(proc.stdout) if proc.returncode == 0 else []:
            label = "tg" if row["n_prompt"] == 0 else "pp512"
            cell[f"{label}_tok_s"] = row["avg_ts"]
            cell[f"{label}_samples_tok_s"] = row.get("samples_ts")
        if "tg_tok_s" in cell:
            cell["tpot_ms"] = 1e3 / cell["tg_tok_s"]
        print(f"llama.cpp depth {depth}: {cell}", file=sys.stderr, flush=True)
        cells.append(cell)
    return cells


def llama_cpp_python(gguf: str, depths: list[int], reps: int, steps: int) -> list[dict]:
    """llama.cpp on the CPU through llama-cpp-python, the same cells as muser's: the whole
    prompt's prefill (TTFT), `steps` greedy decode steps after it, and 512 tokens appended at
    that depth (its pp512), `reps` runs each, medians."""
    import os
    import statistics
    import time

    import llama_cpp
    import numpy as np

    threads = os.cpu_count()
    llm = llama_cpp.Llama(gguf, n_ctx=max(depths) + 512 + steps + 8, n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()
    ids = [2] + [10 + (i * 7919) % (vocab - 20) for i in range(max(depths) + 512)]
    cells = []
    for depth in depths:
        ttft, tpot, chunk = [], [], []
        for _ in range(reps):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids[:depth])
            ttft.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(steps):
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))
                llm.eval([int(logits.argmax())])
            tpot.append((time.perf_counter() - t0) / steps)
            llm.n_tokens = depth  # NOTE: eval drops the cache past n_tokens: back to `depth`
            t0 = time.perf_counter()
            llm.eval(ids[depth:depth + 512])
            chunk.append(time.perf_counter() - t0)
        cell = {"depth": depth, "ttft_s": statistics.median(ttft),
                "tpot_ms": statistics.median(tpot) * 1e3,
                "tpot_samples_ms": [t * 1e3 for t in tpot],
                "pp512_tok_s": 512 / statistics.median(chunk), "load_average": os.getloadavg()}
        print(f"llama-cpp-python depth {depth}: {cell}", file=sys.stderr, flush=True)
        cells.append(cell)
    return cells


def write(receipt: dict, path: Path) -> None:
    """The receipt, with `cells` at its top: one per model and depth, of the first version."""
    first = next(iter(receipt["runs"].values()), {})
    receipt["cells"] = [c for model in first.values() for c in model.get("cells", [])]
    path.write_text(json.dumps(receipt, indent=1) + "\n")


def merged(old: dict | None, new: dict) -> dict:
    """`new`, keeping the cells of `old` at depths `new` did not measure (a matrix measured over
    several calls)."""
    if old is None:
        return new
    depths = {c["depth"] for c in new["cells"]}
    cells = [c for c in old["cells"] if c["depth"] not in depths] + new["cells"]
    return new | {"cells": sorted(cells, key=lambda c: c["depth"])}


def plot(receipt: dict, path: Path) -> None:
    """TPOT and the 512-token chunk's rate against depth, muser beside llama.cpp, a panel per
    model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for run in receipt["runs"].values() for m in run})
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        top, bottom = axes[0][col], axes[1][col]
        for version, run in receipt["runs"].items():
            cells = run.get(model, {}).get("cells", [])
            depths = [c["depth"] for c in cells]
            top.plot(depths, [c["tpot_ms"] for c in cells], "o-", label=f"muser {version}")
            top.plot(depths, [c["floor_ms"] for c in cells], ":", color="gray",
                     label="bandwidth floor" if version == next(iter(receipt["runs"])) else None)
            bottom.plot(depths, [c["chunk512_at_depth_tok_s"] for c in cells], "o-",
                        label=f"muser {version}")
        theirs = receipt.get("llama_cpp", {}).get(model, {}).get("cells", [])
        if theirs:
            depths = [c["depth"] for c in theirs]
            top.plot(depths, [c.get("tpot_ms") for c in theirs], "s--", label="llama.cpp")
            bottom.plot(depths, [c.get("pp512_tok_s") for c in theirs], "s--", label="llama.cpp")
        for ax, label in ((top, "TPOT after the prompt (ms)"),
                          (bottom, "512 tokens appended at depth (tok/s)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("depth (tokens)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        top.set_title(model)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="gemma3-27b")
    ap.add_argument("--depths", default="2048,8192,32768,131008")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--versions", default="head=.", help="name=dir,name=dir (a muser package in each)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", help="a GGUF muser loads (default: dummy weights of "
                    "--model-config; on the CPU, the embedded default model)")
    ap.add_argument("--llama-bench", help="a CUDA llama-bench binary: llama.cpp beside muser")
    ap.add_argument("--llama-cpp-python", action="store_true",
                    help="llama.cpp through llama-cpp-python on --model's file (the CPU run)")
    ap.add_argument("--gguf", help="the GGUF llama-bench reads (the preset's shape)")
    ap.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16", "fp8"],
                    help="the KV cache's dtype in every version (default: the engine's)")
    ap.add_argument("--plot", type=Path, help="a PNG of the receipt")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    receipt = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    if args.device == "cpu" and args.model is None:
        from muser.loading.default_model import default_model_path

        args.model = str(default_model_path(progress=True))
    for entry in args.versions.split(","):
        version, folder = entry.split("=", 1)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(Path(folder).resolve()),
                               args.model_config, args.depths, str(args.reps),
                               str(args.decode_steps), args.device, args.model or "",
                               args.kv_dtype or ""],
                              stdout=subprocess.PIPE, text=True, check=False)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{version}: the process failed (exit {proc.returncode})", file=sys.stderr)
            continue
        runs = receipt["runs"].setdefault(version, {})
        runs[args.model_config] = merged(runs.get(args.model_config), json.loads(line[7:]))
        write(receipt, args.out)
    depths = [int(t) for t in args.depths.split(",")]
    theirs = None
    if args.llama_bench:
        theirs = llama_bench(args.llama_bench, args.gguf, depths, args.reps, args.decode_steps)
        tool = {"gguf": args.gguf, "tool": "llama-bench -ngl 99 -fa 1", "cells": theirs}
    elif args.llama_cpp_python:
        from importlib.metadata import version

        theirs = llama_cpp_python(args.model, depths, args.reps, args.decode_steps)
        tool = {"gguf": args.model, "tool": f"llama-cpp-python {version('llama-cpp-python')}",
                "cells": theirs}
    if theirs is not None:
        ours = receipt.setdefault("llama_cpp", {})
        ours[args.model_config] = merged(ours.get(args.model_config), tool)
    # NOTE: joined from the receipt: llama.cpp's cells of an earlier call pair with these too
    theirs = receipt.get("llama_cpp", {}).get(args.model_config, {}).get("cells")
    if theirs:
        by_depth = {c["depth"]: c for c in theirs if "tpot_ms" in c}
        for run in receipt["runs"].values():
            for cell in run.get(args.model_config, {}).get("cells", []):
                other = by_depth.get(cell["depth"])
                if other:
                    cell["llama_cpp_tpot_ms"] = other["tpot_ms"]
                    cell["decode_vs_llama_cpp"] = other["tpot_ms"] / cell["tpot_ms"]
                    cell["llama_cpp_pp512_tok_s"] = other.get("pp512_tok_s")
                    if other.get("pp512_tok_s"):
                        cell["chunk512_vs_llama_cpp"] = (cell["chunk512_at_depth_tok_s"]
                                                         / other["pp512_tok_s"])
                    if other.get("pp512_samples_tok_s"):  # median against median
                        theirs_median = statistics.median(other["pp512_samples_tok_s"])
                        cell["llama_cpp_pp512_median_tok_s"] = theirs_median
                        cell["chunk512_vs_llama_cpp_median"] = (
                            cell["chunk512_at_depth_tok_s"] / theirs_median)
        write(receipt, args.out)
    if args.plot:
        plot(receipt, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
