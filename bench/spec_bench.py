"""Speculative decoding against plain decoding, side by side in one run (CPU; prompt lookup, or
a draft model with --draft-model).

Each workload is a committed prompt (bench/prompts/spec/*.txt: a passage of 300+ tokens the
continuation reuses: a quotation, an edit, code with one change; and `free`, a story asked for
in two sentences, where little repeats: what speculation costs when it has nothing to copy),
sent through the chat template. Per (workload, k) cell: greedy decode tok/s of the same request on a plain engine and
on a speculating one, alternated `--reps` times (the median of each), the speedup, the share of
draft tokens accepted, the mean tokens a verify pass emitted, and whether the outputs were the
same token for token. One speculating engine serves every k (its rings hold the largest; a
request's SamplingParams.speculative caps its drafts at the cell's k). --verify-costs also
times one forward of 1..9 rows of one sequence (what a verify pass of K drafts costs, against
one decode row). --draft-model PATH|NAME speculates with that draft model (--speculative draft)
in place of prompt lookup.

    python bench/spec_bench.py --out bench/results/spec_cpu.json
    python bench/spec_bench.py --draft-model gemma3-270m --ks 2 4 --out \
        bench/results/spec_draft_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from muser import LLM, SamplingParams

PROMPTS = Path(__file__).parent / "prompts" / "spec"


def _cpu() -> dict:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    name = next((line.split(":", 1)[1].strip() for line in info
                 if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in info
                  if line.startswith("flags")), [])
    return {"model_name": name, "isa": [f for f in ("avx2", "avx512f", "avx512bw", "avx512vnni",
                                                    "avx_vnni", "fma") if f in flags],
            "threads": torch.get_num_threads(), "cores": os.cpu_count()}


def _decode(llm: LLM, ids: list[int], max_tokens: int, k: int | None, temperature: float):
    p = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0, ignore_eos=True,
                       speculative=k)
    return llm.generate(ids, p)


def _verify_costs(llm: LLM, ids: list[int], reps: int) -> dict[int, float]:
    """ms of one forward of w rows (logits of every row) of one sequence after `ids`."""
    r, out = llm.runner, {}
    for width in range(1, 10):
        seq = r.allocate()
        r.prefill(seq, ids)
        times = []
        for i in range(reps):
            start = time.perf_counter()
            r.forward([seq], [ids[i:i + width]], all_logits=True)
            times.append(time.perf_counter() - start)
        r.free(seq)
        out[width] = statistics.median(times) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--workloads", nargs="*", default=sorted(p.stem for p in PROMPTS.glob("*.txt")))
    ap.add_argument("--ks", type=int, nargs="*", default=[2, 3, 4, 5, 6, 8])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; else seeded sampling (seed 0), exact all the same")
    ap.add_argument("--draft-model", metavar="PATH|NAME",
                    help="draft with this model (--speculative draft), not prompt lookup")
    ap.add_argument("--verify-costs", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    kw = {"progress": False, "device": "cpu", "max_num_seqs": 1, "max_model_len": 4096}
    plain = LLM(args.model, **kw)
    how = ({"speculative": "draft", "speculative_model": args.draft_model} if args.draft_model
           else {"speculative": "ngram"})
    spec = LLM(args.model, num_speculative_tokens=max(args.ks), **how, **kw)
    draft = Path(args.draft_model).name if args.draft_model else "ngram"
    stats = spec.engine.speculation.stats
    cells = []
    for workload in args.workloads:
        text = (PROMPTS / f"{workload}.txt").read_text()
        ids = plain.tokenizer.encode(plain.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}]))
        want = _decode(plain, ids, args.max_tokens, None, args.temperature)  # NOTE: also warms both engines
        _decode(spec, ids, 8, None, args.temperature)
        plain_tps, spec_tps = [], {k: [] for k in args.ks}
        exact, counts = dict.fromkeys(args.ks, True), {k: [0, 0, 0] for k in args.ks}
        for _ in range(args.reps):  # NOTE: each rep runs plain, then every k, in turn
            plain_tps.append(_decode(plain, ids, args.max_tokens, None,
                                    args.temperature).decode_tokens_per_s)
            for k in args.ks:
                before = (stats.drafted, stats.accepted, stats.verified)
                got = _decode(spec, ids, args.max_tokens, k, args.temperature)
                spec_tps[k].append(got.decode_tokens_per_s)
                exact[k] &= got.token_ids == want.token_ids
                for i, (now, then) in enumerate(zip((stats.drafted, stats.accepted,
                                                     stats.verified), before)):
                    counts[k][i] += now - then
        a_plain = statistics.median(plain_tps)
        for k in args.ks:
            d, a, v = counts[k]
            a_spec = statistics.median(spec_tps[k])
            cell = {"model": plain.path.name if plain.path else "default", "draft": draft,
                    "k": k, "workload": workload, "temperature": args.temperature, "batch": 1, "prompt_tokens": len(ids),
                    "output_tokens": args.max_tokens, "tokens_per_s_plain": round(a_plain, 2),
                    "tokens_per_s_spec": round(a_spec, 2), "speedup": round(a_spec / a_plain, 3),
                    "acceptance_rate": round(a / d, 3) if d else 0.0,
                    "mean_accepted_length": round((a + v) / v, 3) if v else 1.0,
                    "exact": exact[k]}
            print(json.dumps(cell), flush=True)
            cells.append(cell)
    receipt = {"bench": "bench/spec_bench.py", "cpu": _cpu(), "reps": args.reps,
               "measure": "median decode tok/s (after the first token) over the reps; each rep "
                          "runs the plain engine, then the speculating one at every k",
               "cells": cells}
    if args.verify_costs:
        ids = plain.tokenizer.encode((PROMPTS / "quotation.txt").read_text())
        receipt["verify_ms"] = _verify_costs(spec, ids, 2 * args.reps + 5)
        print(json.dumps(receipt["verify_ms"]))
    if args.out:
        Path(args.out).write_text(json.dumps(receipt, indent=1) + "\n")


if __name__ == "__main__":
    main()
