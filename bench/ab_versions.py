"""Two versions of muser side by side on one GPU: gemma3-1b prefill and decode, each version in
its own process, the processes alternating (A B A B ...), so both meet the same host.

    python3 bench/ab_versions.py --versions base=bench/ab_base,head=. --rounds 2 --out DIR

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
from muser.runner import Runner

lengths, reps = [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
cfg = preset("gemma3-1b")
weights = random_weights(cfg, torch.bfloat16, "cuda", seed=0)
runner = Runner(cfg, EngineConfig(device="cuda", max_num_seqs=1, max_model_len=8320,
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", required=True, help="name=dir,name=dir")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    versions = dict(v.split("=") for v in args.versions.split(","))
    runs = []
    for r in range(args.rounds):
        for name, root in versions.items():
            proc = subprocess.run([sys.executable, "-c", CHILD, str(Path(root).resolve()),
                                   args.lengths, str(args.reps)],
                                  capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
                raise SystemExit(f"{name} failed (exit {proc.returncode})")
            res = json.loads(line[7:])
            runs.append({"round": r, "version": name, **res})
            print(f"round {r} {name}: prefill ms {res['prefill_ms']} (host "
                  f"{res['prefill_host_ms']}), decode step {res['decode_step_ms']:.3f} ms",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_versions.json").write_text(json.dumps({"versions": versions, "runs": runs},
                                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
