"""Where a 2,048-token prefill's GPU time goes, bf16 against FP8 weights (issue 18's prefill
bar), and what the prefill chunk's width does to each: one process per (format, chunk), dummy
weights of the preset, batch 1, prefix cache off.

    python3 bench/prefill_profile.py --model-config gemma3-27b --out $OUT/prefill_profile.json

Per process: TTFT of 2,048 exact tokens (the median of --reps runs after a warm run), then one
more run under torch.profiler: CUDA kernel time summed per kernel name, grouped into
categories by name (gemm: cuBLAS / cutlass / scaled_mm / Triton GEMM kernels; attention;
quantize: activation quantization to e4m3; norm_rope; other), and the host's wall time of the
same run, so host-bound gaps show as wall - kernel time.

With --at-depth D the prefill profiled is --tokens new tokens appended to a cached prefix of D
(issue 17's chunk at depth): the prefix is computed once with the prefix cache on, and each run
appends tokens of its own, so its TTFT is the prefix's restore plus the new tokens' prefill.

    python3 bench/prefill_profile.py --runs bf16:512 --tokens 512 --at-depth 130559 --out ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
import torch
from muser import LLM, SamplingParams
name, fmt, chunk, reps, depth = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
at = int(sys.argv[6])
llm = LLM(None, device="cuda", load_format="dummy", model_config=name, progress=False,
          quantization="fp8" if fmt == "fp8" else "none", max_num_seqs=1, prefix_cache=at > 0,
          max_model_len=at + depth + 64, prefill_chunk=chunk)
vocab = llm.model_config.vocab_size
prefix = torch.randint(10, vocab - 10, (at,), generator=torch.Generator().manual_seed(2)).tolist()
def prompt(seed):  # at depth: a tail of its own per run, so no run finds another's cached
    return prefix + torch.randint(10, vocab - 10, (depth,),
                                  generator=torch.Generator().manual_seed(seed)).tolist()
one = SamplingParams(max_tokens=1, ignore_eos=True)
if at:
    llm.generate(prefix, one)  # leaves its end checkpoint at `at`
llm.generate(prompt(1), one)
ttft = statistics.median(llm.generate(prompt(10 + i if at else 1), one).ttft_s for i in range(reps))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    llm.generate(prompt(99 if at else 1), one)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
kernels = {}
for e in prof.key_averages():
    if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
        kernels[e.key] = kernels.get(e.key, 0.0) + e.self_device_time_total / 1e3
def category(k):
    s = k.lower()
    if "attention" in s or "flash" in s or "_attn" in s or "fmha" in s:
        return "attention"
    if "quantize" in s:
        return "quantize"
    if "gemm" in s or "cutlass" in s or "sm90_xmma" in s or "nvjet" in s or "matmul" in s or "_mm_" in s:
        return "gemm"
    if "norm" in s or "rope" in s:
        return "norm_rope"
    return "other"
cats = {}
for k, ms in kernels.items():
    cats[category(k)] = cats.get(category(k), 0.0) + ms
top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
print("RESULT " + json.dumps({"model": name, "quantization": fmt, "prefill_chunk": chunk,
      "tokens": depth, "at_depth": at, "ttft_s": ttft, "prefill_tok_s": depth / ttft, "profiled_wall_ms": wall * 1e3,
      "kernel_ms": sum(kernels.values()), "by_category_ms": cats, "top_kernels_ms": dict(top)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="gemma3-27b")
    ap.add_argument("--runs", default="bf16:512,fp8:512,fp8:2048,bf16:2048",
                    help="format:chunk,... one process each, in this order")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--at-depth", type=int, default=0, metavar="D",
                    help="append the --tokens to a cached prefix of D tokens")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    receipt = {"model": args.model_config, "cells": []}
    for run in args.runs.split(","):
        fmt, chunk = run.split(":")
        proc = subprocess.run([sys.executable, "-c", CHILD, args.model_config, fmt, chunk,
                               str(args.reps), str(args.tokens), str(args.at_depth)],
                              stdout=subprocess.PIPE, text=True, check=False)  # a failed process: reported below
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{run}: the process failed (exit {proc.returncode})", file=sys.stderr)
            continue
        cell = json.loads(line[7:])
        print(f"{run}: {cell['prefill_tok_s']:.0f} tok/s, kernels {cell['kernel_ms']:.1f} ms "
              f"of {cell['profiled_wall_ms']:.1f} ms: "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cell['by_category_ms'].items())),
              file=sys.stderr, flush=True)
        receipt["cells"].append(cell)
        args.out.write_text(json.dumps(receipt, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
