"""Two versions of muser side by side on one machine: prefill and decode, each version in its
own process, the processes alternating (A B A B ...), so both meet the same host.

    python3 bench/ab_versions.py --versions base=bench/ab_base,head=. --rounds 2 --out DIR
    python3 bench/ab_versions.py --device cpu --lengths 512,2048 --reps 3 --versions ...

On the GPU: gemma3-1b with seeded random bf16 weights; on the CPU: the embedded Gemma 3 270M
GGUF in float32 (the CPU default), prompts prefilled as served (`LLM.generate` of one token:
the engine's chunks, prefix cache off), decode steps after a 32-token prompt, of one sequence
and of a batch of 8 (`decode8_step_ms`).

Each entry names a directory holding a `muser` package; an earlier commit's, for example, from
`mkdir -p bench/ab_base && git archive <commit> muser | tar -x -C bench/ab_base` (left
untracked, so the device call carries it). Per process: seeded random bf16
weights, one warm-up pass, then for each prompt length a fresh sequence's one-chunk prefill,
timed `--reps` times with the lengths interleaved, and the median decode step after 2,048
tokens. Writes DIR/ab_versions.json.
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
sys.path.insert(0, sys.argv[1])
from muser.config import EngineConfig
from muser.graph.weights import random_weights
from muser.presets import preset
try:
    from muser.startup.start import start  # a version whose startup drives the runner
except ImportError:
    from muser.runner import Runner as start  # an earlier one: its runner warms itself up

lengths, reps = [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
cfg = preset("gemma3-1b")
weights = random_weights(cfg, torch.bfloat16, "cuda", seed=0)
runner = start(cfg, EngineConfig.for_device(device="cuda", max_num_seqs=1, max_model_len=8320,
                                            prefill_chunk=8320), weights)
ids = torch.randint(0, cfg.vocab_size, (max(lengths),),
                    generator=torch.Generator().manual_seed(1)).tolist()


def prefill(t):
    seq = runner.allocate()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.forward([seq], [ids[:t]])
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    runner.free(seq)
    return time.perf_counter() - t0, host


for t in lengths:  # warm-up: compiles every specialization
    prefill(t)
times = {t: [] for t in lengths}
hosts = {t: [] for t in lengths}
for _ in range(reps):
    for t in lengths:
        s, h = prefill(t)
        times[t].append(s)
        hosts[t].append(h)
seq = runner.allocate()
logits = runner.forward([seq], [ids[:2048]])
steps = []
for _ in range(40):
    token = int(logits[-1].argmax())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = runner.forward([seq], [[token]])
    torch.cuda.synchronize()
    steps.append(time.perf_counter() - t0)
print("RESULT " + json.dumps({
    "prefill_ms": {t: statistics.median(v) * 1e3 for t, v in times.items()},
    "prefill_host_ms": {t: statistics.median(v) * 1e3 for t, v in hosts.items()},
    "prefill_samples_ms": {t: [round(x * 1e3, 3) for x in v] for t, v in times.items()},
    "decode_step_ms": statistics.median(steps[5:]) * 1e3,
}))
"""

CPU_CHILD = r"""
import json, statistics, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from muser import LLM, SamplingParams

lengths, reps = [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
llm = LLM(progress=False, device="cpu", max_num_seqs=8, max_model_len=max(lengths) + 256,
          prefix_cache=False)
runner = llm.runner
ids = [2] + torch.randint(1000, 200_000, (max(lengths),),
                          generator=torch.Generator().manual_seed(1)).tolist()
one = SamplingParams(max_tokens=1, ignore_eos=True)


def prefill(t):  # as served: the engine's chunks and the first token
    t0 = time.perf_counter()
    llm.generate(ids[:t], one)
    return time.perf_counter() - t0


for t in lengths:
    prefill(t)
times = {t: [] for t in lengths}
for _ in range(reps):
    for t in lengths:
        times[t].append(prefill(t))
seq = runner.allocate()
logits = runner.forward([seq], [ids[:32]])
steps = []
for _ in range(64):
    token = int(logits[-1].argmax())
    t0 = time.perf_counter()
    logits = runner.forward([seq], [[token]])
    steps.append(time.perf_counter() - t0)
runner.free(seq)
seqs = [runner.allocate() for _ in range(8)]  # a batch of 8 after 32 tokens each
logits = runner.forward(seqs, [ids[1 + i:33 + i] for i in range(8)])
steps8 = []
for _ in range(24):
    tokens = [[int(t)] for t in logits.argmax(-1)]
    t0 = time.perf_counter()
    logits = runner.forward(seqs, tokens)
    steps8.append(time.perf_counter() - t0)
print("RESULT " + json.dumps({
    "prefill_ms": {t: statistics.median(v) * 1e3 for t, v in times.items()},
    "prefill_host_ms": {t: statistics.median(v) * 1e3 for t, v in times.items()},
    "prefill_samples_ms": {t: [round(x * 1e3, 3) for x in v] for t, v in times.items()},
    "prefill_tok_s": {t: t / statistics.median(v) for t, v in times.items()},
    "decode_step_ms": statistics.median(steps[4:]) * 1e3,
    "decode_tok_s": 1 / statistics.median(steps[4:]),
    "decode8_step_ms": statistics.median(steps8[4:]) * 1e3,
    "decode8_tok_s": 8 / statistics.median(steps8[4:]),
}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", required=True, help="name=dir,name=dir")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    versions = dict(v.split("=") for v in args.versions.split(","))
    runs = []
    for r in range(args.rounds):
        for name, root in versions.items():
            child = CPU_CHILD if args.device == "cpu" else CHILD
            proc = subprocess.run([sys.executable, "-c", child, str(Path(root).resolve()),
                                   args.lengths, str(args.reps)],
                                  capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
                raise SystemExit(f"{name} failed (exit {proc.returncode})")
            res = json.loads(line[7:])
            runs.append({"round": r, "version": name, **res})
            batch8 = (f", batch 8 {res['decode8_step_ms']:.3f} ms" if "decode8_step_ms" in res
                      else "")
            print(f"round {r} {name}: prefill ms {res['prefill_ms']} (host "
                  f"{res['prefill_host_ms']}), decode step {res['decode_step_ms']:.3f} ms"
                  f"{batch8}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "ab_versions.json" if args.device == "cuda" else "ab_versions_cpu.json"
    (out / name).write_text(json.dumps({"device": args.device, "versions": versions,
                                        "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
