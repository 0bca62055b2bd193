"""Speculative decoding on a GPU, side by side with plain decoding in one process, with dummy
weights (no checkpoint travels to the device machine) and acceptance under control.

Dummy weights give drafts nothing real to match, so the drafts come from an oracle: a plain
greedy run of the same request first records the target's own continuation; then, when a
sequence asks for k drafts, each of the next k recorded tokens is kept with probability p and
otherwise replaced by another token (seeded), so draft i+1 holds given draft i did with
probability p — the acceptance the curve is drawn over. The verify pass and everything after
it are the engine's own (`Speculation`, the verify rows through the layer graph), so the
outputs must still be plain decoding's token for token (`exact`).

Cells {model, draft, k, workload, batch, tokens_per_s_plain, tokens_per_s_spec, speedup,
acceptance_rate, mean_accepted_length, exact}: decode tok/s (after the first token) of
`--batch` requests at once, plain then speculating, alternated --reps times (medians).
verify_ms: one forward of w = 1..9 rows of one sequence at depth 2,048 against a decode step.

    python3 bench/spec_gpu.py --model-config gemma3-27b --ps 0.5,0.7,0.9 --ks 2,4,6 \
        --tokenizer-gguf .devcarry/tokenizer.gguf --out $OUT/spec_h200.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SYNC = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


class Oracle:
    """Drafts from recorded continuations (prompt tuple -> tokens), each kept with p."""

    def __init__(self, p: float, vocab: int, seed: int = 0) -> None:
        self.p, self.vocab, self.rng = p, vocab, random.Random(seed)
        self.truth: dict[tuple[int, ...], list[int]] = {}

    def propose(self, seq, k: int) -> list[int]:
        want = self.truth.get(tuple(seq.prompt_ids), [])[len(seq.output_ids):][:k]
        return [t if self.rng.random() < self.p else (t + 1 + self.rng.randrange(99)) % self.vocab
                for t in want]


def run(llm, prompts: list[list[int]], tokens: int, spec: int | None) -> tuple[float, list]:
    """All prompts at once through the engine -> (decode tok/s after each first token, outputs)."""
    from muser import SamplingParams

    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True,
                                              speculative=spec)) for p in prompts]
    got = {r.uid: [] for r in reqs}
    first = None
    while eng.has_work:
        for o in eng.step():
            got[o.uid].append(o.token_id)
        if first is None and all(got.values()):
            SYNC()
            first, done = time.perf_counter(), sum(map(len, got.values()))
    wall = time.perf_counter() - first
    return (sum(map(len, got.values())) - done) / wall, [got[r.uid] for r in reqs]


def verify_costs(llm, ids: list[int], reps: int) -> dict[int, float]:
    r, out = llm.runner, {}
    for width in range(1, 10):
        seq = r.allocate()
        r.forward([seq], [ids])
        times = []
        for i in range(reps):
            SYNC()
            t0 = time.perf_counter()
            r.forward([seq], [ids[i:i + width]], all_logits=width > 1)
            SYNC()
            times.append(time.perf_counter() - t0)
        r.free(seq)
        out[width] = round(statistics.median(times) * 1e3, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="gemma3-1b")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8"])
    ap.add_argument("--ps", default="0.5,0.7,0.9", help="draft acceptance per token")
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokenizer-gguf", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the bench itself")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.tokenizer_gguf:
        sys.path.insert(0, str(Path(__file__).parent))
        from startup_h200 import standin_package
        sys.path.insert(0, str(standin_package(args.tokenizer_gguf, Path(tempfile.mkdtemp()))))
    from muser import LLM

    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(None, progress=False, load_format="dummy", model_config=args.model_config,
              device=args.device, quantization=args.quantization, max_num_seqs=max(batches),
              max_model_len=args.depth + args.tokens + 64, speculative="ngram",
              num_speculative_tokens=max(ks))
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, vocab - 10, (args.depth,), generator=g).tolist()
               for _ in range(max(batches))]
    stats = llm.engine.speculation.stats
    receipt = {"bench": "bench/spec_gpu.py", "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "model": args.model_config, "weights": args.quantization, "cells": []}
    run(llm, prompts[:2], 8, 0)  # warm
    for batch in batches:
        truth = {tuple(p): o for p, o in zip(prompts[:batch],
                                             run(llm, prompts[:batch], args.tokens, 0)[1])}
        for p in [float(x) for x in args.ps.split(",")]:
            oracle = Oracle(p, vocab)
            oracle.truth = truth
            llm.engine.speculation.proposer = oracle
            for k in ks:
                plain, spec, exact, counts = [], [], True, [0, 0, 0]
                for _ in range(args.reps):
                    tps, outs = run(llm, prompts[:batch], args.tokens, 0)
                    plain.append(tps)
                    exact &= outs == [truth[tuple(q)] for q in prompts[:batch]]
                    before = (stats.drafted, stats.accepted, stats.verified)
                    tps, outs = run(llm, prompts[:batch], args.tokens, k)
                    spec.append(tps)
                    exact &= outs == [truth[tuple(q)] for q in prompts[:batch]]
                    for i, (now, then) in enumerate(zip((stats.drafted, stats.accepted,
                                                         stats.verified), before)):
                        counts[i] += now - then
                d, a, v = counts
                cell = {"model": args.model_config, "draft": f"oracle p={p}", "k": k,
                        "workload": f"random {args.depth}-token prompts, {args.tokens} out",
                        "batch": batch, "tokens_per_s_plain": round(statistics.median(plain), 2),
                        "tokens_per_s_spec": round(statistics.median(spec), 2),
                        "speedup": round(statistics.median(spec) / statistics.median(plain), 3),
                        "acceptance_rate": round(a / d, 3) if d else 0.0,
                        "mean_accepted_length": round((a + v) / v, 3) if v else 1.0,
                        "exact": exact}
                print(json.dumps(cell), flush=True)
                receipt["cells"].append(cell)
                args.out.write_text(json.dumps(receipt, indent=1))
    receipt["verify_ms"] = verify_costs(llm, prompts[0], 7)
    print(json.dumps(receipt["verify_ms"]), flush=True)
    args.out.write_text(json.dumps(receipt, indent=1))


if __name__ == "__main__":
    main()
