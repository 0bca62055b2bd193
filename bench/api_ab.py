"""Two versions of muser through the public API on one GPU: the same outputs bit for bit, and
decode, prefill and W1's shape timed, each version in its own process, alternating.

    python3 bench/api_ab.py --versions base=bench/ab_base,head=. --rounds 2 --out DIR
    python3 bench/api_ab.py --versions ... --model-config gemma3-27b --quantization fp8 \
        --timing-only --depths 2048,32768 --tokenizer-gguf .devcarry/tokenizer.gguf --out DIR

Each entry names a directory holding a `muser` package (an earlier commit's from
`mkdir -p bench/ab_base && git archive <commit> muser | tar -x -C bench/ab_base`). Per process:
gemma3-1b with seeded dummy bf16 weights (`LLM(load_format="dummy")`, max_num_seqs 32), then
every token id, logprob (6 decimals), finish reason and prompt logprob of 8 seeded prompts (5 to
3,000 tokens) alone and together, one prompt's n=3 seeded samples, prompt_logprobs=2, and
max_tokens 1 and 7 (through `Engine.add_request` / `step`); then the timings: TTFT of a fresh
2,048-token prompt (median of 5), TPOT of one stream after 2,048 tokens (median gap of 128,
median of 3), and W1's shape in process (32 requests of 512 in / 128 out through
`Engine.step`, output tok/s, median of 3). Writes DIR/api_ab.json: per check whether every
version's outputs equal the first's, and per metric each round's value and the ratio of means.
--model-config and --quantization pick another preset and its weights; --timing-only skips the
outputs; --depths adds TPOT cells at other depths (tpot_32k_ms for 32,768); --tokenizer-gguf
stands in for the embedded model package (bench/startup_h200.py standin_package).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(root: str, args: argparse.Namespace) -> None:
    sys.path.insert(0, root)
    import torch

    from muser import LLM, SamplingParams

    depths = [int(d) for d in args.depths.split(",")]
    llm = LLM(None, progress=False, load_format="dummy", model_config=args.model_config,
              device="cuda", max_num_seqs=32, max_model_len=max(8192, max(depths) + 256),
              quantization=args.quantization)
    eng = llm.engine
    g = torch.Generator().manual_seed(7)
    V = 20000


    def ids(n):
        return torch.randint(10, V, (n,), generator=g).tolist()


    prompts = [ids(n) for n in (5, 100, 700, 1500, 2100, 600, 3000, 33)]
    out = {}


    def drive(reqs):
        """Run requests to the end through engine.step -> per uid list of (token, logprob)."""
        got = {}
        uids = set()
        for p, s in reqs:
            r = eng.add_request(p, s)
            uids.add(r.uid)
        while eng.has_work:
            for o in eng.step():
                key = f"{o.uid}:{o.index}"
                got.setdefault(key, []).append(
                    [o.token_id, None if o.logprobs is None else round(o.logprobs.logprob, 6),
                     o.finish_reason])
                if o.prompt_logprobs:
                    got.setdefault(key + ":prompt", []).extend(
                        [lp.logprob, list(lp.top)] for lp in o.prompt_logprobs)
        # renumber by submission order (uids differ between runs)
        order = sorted({k.split(":")[0] for k in got}, key=int)
        return {str(order.index(k.split(":")[0])) + k[len(k.split(":")[0]):]: v
                for k, v in got.items()}


    greedy = SamplingParams(max_tokens=40, logprobs=3)
    if args.timing_only:
        prompts = []
    out["alone"] = [drive([(p, greedy)]) for p in prompts]
    out["together"] = drive([(p, greedy) for p in prompts])
    if args.timing_only:
        out = {}
    else:
        out["sampled_n3"] = drive([(prompts[2], SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9,
                                                               seed=5, n=3))])
        out["prompt_lp"] = drive([(prompts[1], SamplingParams(max_tokens=4, prompt_logprobs=2))])
        out["stop_len"] = drive([(prompts[0], SamplingParams(max_tokens=1)),
                                 (prompts[5], SamplingParams(max_tokens=7, ignore_eos=True))])
    torch.cuda.synchronize()

    # timings
    def ttft(n):
        p = ids(n)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        llm.generate(p, SamplingParams(max_tokens=1))
        return time.perf_counter() - t0

    def tpot(depth, steps=128):
        r = eng.add_request(ids(depth), SamplingParams(max_tokens=steps, ignore_eos=True))
        stamps = []
        for o in eng.run(r):
            stamps.append(time.perf_counter())
        gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # NOTE: after the first token
        return statistics.median(gaps)

    def w1(conc=32, n_in=512, n_out=128):
        reqs = [ids(n_in) for _ in range(conc)]
        t0 = time.perf_counter()
        for p in reqs:
            eng.add_request(p, SamplingParams(max_tokens=n_out, ignore_eos=True))
        toks = 0
        while eng.has_work:
            toks += sum(o.token_id is not None for o in eng.step())
        return toks / (time.perf_counter() - t0)

    ttft(2048); tpot(2048, 16); w1(8, 64, 8)  # warm
    timing = {"ttft_2048_ms": statistics.median(ttft(2048) for _ in range(5)) * 1e3}
    for depth in depths:
        timing[f"tpot_{depth // 1024}k_ms"] = statistics.median(
            tpot(depth) for _ in range(3 if depth <= 8192 else 2)) * 1e3
    timing["w1_offline_tok_s"] = statistics.median(w1() for _ in range(3))
    print("RESULT " + json.dumps({"outputs": out, "timing": timing}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", required=True, help="NAME=DIR,NAME=DIR (the first is the base)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model-config", default="gemma3-1b")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8"])
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--depths", default="2048", help="TPOT depths, comma-separated")
    ap.add_argument("--tokenizer-gguf", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.tokenizer_gguf:
            import tempfile

            from startup_h200 import standin_package
            sys.path.insert(0, str(standin_package(args.tokenizer_gguf,
                                                   Path(tempfile.mkdtemp()))))
        return child(args.child, args)
    versions = [v.split("=", 1) for v in args.versions.split(",")]
    results = {name: [] for name, _ in versions}
    for _ in range(args.rounds):
        for name, root in versions:
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:],
                                   "--child", str(Path(root).resolve())],
                                  check=False, capture_output=True, text=True, timeout=900)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                sys.exit(f"{name}: no result\n{proc.stderr[-2000:]}")
            results[name].append(json.loads(line[0][7:]))
            print(name, results[name][-1]["timing"], flush=True)
    base = versions[0][0]
    first = results[base][0]["outputs"]  # NOTE: empty with --timing-only
    checks = {k: {name: all(r["outputs"][k] == first[k] for r in runs)
                  for name, runs in results.items()} for k in first}
    metrics = {m: {name: [r["timing"][m] for r in runs] for name, runs in results.items()}
               for m in results[base][0]["timing"]}
    for values in metrics.values():
        values["ratios"] = {name: statistics.mean(values[name]) / statistics.mean(values[base])
                            for name, _ in versions[1:]}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "api_ab.json" if args.model_config == "gemma3-1b" and args.quantization == "none" \
        else f"api_ab_{args.model_config}_{args.quantization}.json"
    (args.out / name).write_text(json.dumps({"checks": checks, "metrics": metrics,
                                             "model": args.model_config,
                                             "quantization": args.quantization,
                                             "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    print(json.dumps(checks), json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
