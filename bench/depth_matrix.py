"""Context depth on the GPU: TTFT of a whole prompt and TPOT after it, at depths up to 131,008,
for one or more versions of muser side by side (each in its own process, one after another).

    python3 bench/depth_matrix.py --model-config gemma3-27b --depths 2048,8192,32768,131008 \
        --versions head=. --out $OUT/depth_h200.json
    python3 bench/depth_matrix.py --versions base=.devcarry/ab_depth,head=. ...   # an A/B
    python3 bench/depth_matrix.py ... --llama-bench /tmp/llama/bin/llama-bench \
        --gguf /dev/shm/gemma3-27b-bf16.gguf       # llama.cpp on the same shape, same call

With --llama-bench (bench/llama_cpp_cuda.sh builds it; bench/synth_gguf.py writes the file of
the preset's shape): `llama-bench -ngl 99 -fa 1 -d DEPTH` per depth, --reps runs, decode of
--decode-steps tokens (tg) and a 512-token prompt appended at that depth (pp512); each
version's cells gain llama_cpp_tpot_ms and decode_vs_llama_cpp (llama.cpp ms / muser ms).

Per process: seeded dummy bf16 weights of the preset, no prefix reuse, one sequence. Per depth:
--reps runs of `LLM.generate` over `depth` exact tokens with max_tokens = --decode-steps + 1
(greedy, ignore_eos): TTFT is the whole prompt's prefill and first token, TPOT the mean of the
decode steps after it; the median of each over the runs. Then --reps times a 512-token chunk
appended at that depth: the prompt of `depth` tokens once with the prefix cache on, then it
plus 512 new tokens, whose TTFT is the restore of the cached `depth` and the chunk's prefill. fraction_of_floor = the step's bytes
(every weight once, plus the K/V rows the step reads: the prompt's on full layers, the window's
on sliding layers) / the copy bandwidth measured in the same process, / TPOT. The receipt is
rewritten after each process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys
import torch
sys.path.insert(0, sys.argv[1])
from muser import LLM, SamplingParams

name, depths, reps, steps = sys.argv[2], [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5])
x = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(10):
    y.copy_(x)
b.record()
b.synchronize()
copy_bw = 2 * x.nbytes * 10 / (a.elapsed_time(b) / 1e3)
del x, y
llm = LLM(None, load_format="dummy", model_config=name, device="cuda", max_num_seqs=1,
          max_model_len=max(depths) + 512 + steps + 8, prefix_cache=True, progress=False)
cache, llm.runner.prefix = llm.runner.prefix, None  # NOTE: on only for the appended chunk
cfg = llm.model_config
for depth in [d for d in depths if d + 512 + steps + 1 > llm.config.max_model_len]:
    print(f"{name}: depth {depth} skipped: the context holds {llm.config.max_model_len}",
          file=sys.stderr, flush=True)
depths = [d for d in depths if d + 512 + steps + 1 <= llm.config.max_model_len]
weight_bytes = llm.runner.model.weights.nbytes()
row_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V of one position, bf16
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
    chunk = []  # 512 new tokens after a cached prefix of `depth`: restore + their prefill
    for _ in range(reps):
        llm.runner.prefix = cache
        cache.reset(llm.runner.pages)
        first = SamplingParams(max_tokens=1)
        llm.generate(ids[:depth], first)  # leaves its end checkpoint at `depth`
        before = cache.stats().tokens_reused
        chunk.append(llm.generate(ids[:depth + 512], first).ttft_s)
        assert cache.stats().tokens_reused - before == depth, "the prefix was not reused"
        cache.reset(llm.runner.pages)
        llm.runner.prefix = None
    step_bytes = weight_bytes + row_bytes * (n_full * depth + n_sliding * min(depth, cfg.sliding_window))
    cells.append({"model": name, "depth": depth, "reps": reps, "ttft_s": ttft,
                  "tpot_ms": tpot * 1e3, "ttft_samples_s": [r.ttft_s for r in runs],
                  "tpot_samples_ms": [r.tpot_s * 1e3 for r in runs],
                  "prefill_tok_s": depth / ttft, "step_bytes": step_bytes,
                  "chunk512_at_depth_s": statistics.median(chunk),
                  "chunk512_at_depth_tok_s": 512 / statistics.median(chunk),
                  "floor_ms": step_bytes / copy_bw * 1e3,
                  "fraction_of_floor": step_bytes / copy_bw / tpot})
    print(f"{name} depth {depth}: TTFT {ttft:.3f} s, TPOT {tpot * 1e3:.2f} ms "
          f"(floor {step_bytes / copy_bw * 1e3:.2f} ms)", file=sys.stderr, flush=True)
print("RESULT " + json.dumps({"copy_bytes_per_s": copy_bw, "weight_bytes": weight_bytes,
                              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cells": cells}))
"""


def llama_cpp(binary: str, gguf: str, depths: list[int], reps: int, steps: int) -> list[dict]:
    cells = []
    for depth in depths:
        cell = {"depth": depth}
        for label, flags in (("tg", ["-p", "0", "-n", str(steps)]),
                             ("pp512", ["-p", "512", "-n", "0"])):
            proc = subprocess.run([binary, "-m", gguf, "-ngl", "99", "-fa", "1", "-d", str(depth),
                                   "-r", str(reps), "-o", "json", *flags],
                                  stdout=subprocess.PIPE, text=True)
            rows = json.loads(proc.stdout) if proc.returncode == 0 else []
            if rows:
                cell[f"{label}_tok_s"] = rows[0]["avg_ts"]
                cell[f"{label}_samples_tok_s"] = rows[0].get("samples_ts")
        if "tg_tok_s" in cell:
            cell["tpot_ms"] = 1e3 / cell["tg_tok_s"]
        print(f"llama.cpp depth {depth}: {cell}", file=sys.stderr, flush=True)
        cells.append(cell)
    return cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="gemma3-27b")
    ap.add_argument("--depths", default="2048,8192,32768,131008")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--versions", default="head=.", help="name=dir,name=dir (a muser package in each)")
    ap.add_argument("--llama-bench", help="a CUDA llama-bench binary: llama.cpp beside muser")
    ap.add_argument("--gguf", help="the GGUF llama-bench reads (the preset's shape)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    receipt = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    for entry in args.versions.split(","):
        version, folder = entry.split("=", 1)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(Path(folder).resolve()),
                               args.model_config, args.depths, str(args.reps),
                               str(args.decode_steps)], stdout=subprocess.PIPE, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{version}: the process failed (exit {proc.returncode})", file=sys.stderr)
            continue
        receipt["runs"].setdefault(version, {})[args.model_config] = json.loads(line[7:])
        args.out.write_text(json.dumps(receipt, indent=1) + "\n")
    if args.llama_bench:
        depths = [int(t) for t in args.depths.split(",")]
        theirs = llama_cpp(args.llama_bench, args.gguf, depths, args.reps, args.decode_steps)
        receipt.setdefault("llama_cpp", {})[args.model_config] = {"gguf": args.gguf,
                                                                  "cells": theirs}
        by_depth = {c["depth"]: c for c in theirs if "tpot_ms" in c}
        for run in receipt["runs"].values():
            for cell in run.get(args.model_config, {}).get("cells", []):
                other = by_depth.get(cell["depth"])
                if other:
                    cell["llama_cpp_tpot_ms"] = other["tpot_ms"]
                    cell["decode_vs_llama_cpp"] = other["tpot_ms"] / cell["tpot_ms"]
                    cell["llama_cpp_pp512_tok_s"] = other.get("pp512_tok_s")
        args.out.write_text(json.dumps(receipt, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
