"""Multi-turn chat benchmark: TTFT per turn with and without prefix reuse, side by side.

--conversations conversations of --turns turns, interleaved (turn 1 of every conversation,
then turn 2, ...). A conversation starts with a --first-token prompt; each later turn's prompt
is the previous prompt + the previous answer (--answer tokens, greedy) + --append new tokens,
so the context grows by answer + append tokens a turn. Prompts are seeded random ids. Every
request runs alone, so its TTFT is its prefill (and, with reuse, the restore of its prefix),
through one engine with its prefix cache switched on and off (off: nothing restored, nothing
saved, as with --no-prefix-cache), alternating which goes first. On the CPU both must give the
same tokens (the same bits); on the GPU the receipt counts the greedy tokens that match and
where the first difference falls.

    python bench/prefix_bench.py --device cpu --threads 1 --out bench/results/prefix_cpu.json \\
        --plot bench/results/prefix_cpu.png          # the committed receipt: 2 shared cores
    python bench/prefix_bench.py --device cuda --load-format dummy --model-config gemma3-27b \\
        --conversations 16 --turns 8 --first 2048 --append 200 --max-model-len 32768 --out R.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from muser import LLM, SamplingParams
from muser.engine_args import add_engine_args, engine_kwargs, model_kwargs


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first", type=int, default=512, help="tokens of a first turn's prompt")
    p.add_argument("--append", type=int, default=200, help="new tokens a later turn adds")
    p.add_argument("--answer", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON receipt")
    p.add_argument("--plot", type=Path, help="PNG: TTFT per turn, with and without reuse")
    args = p.parse_args()
    args.max_model_len = min(args.max_model_len, args.first + args.turns * (
        args.append + args.answer) + 64)
    return args


def _run(llm: LLM, ids: list[int], answer: int) -> dict:
    """One request alone -> its TTFT, tokens and reused prompt tokens."""
    req = llm.engine.add_request(ids, SamplingParams(max_tokens=answer, ignore_eos=True))
    for _ in llm.engine.run(req):
        pass
    return {"ttft_s": req.first_token_s - req.arrival_s, "token_ids": list(req.output_ids),
            "reused": req.num_reused}


def _summary(requests: list[dict], turns: int) -> list[dict]:
    rows = []
    for turn in range(turns):
        cell = [r for r in requests if r["turn"] == turn]
        reuse = statistics.median(r["reuse"]["ttft_s"] for r in cell)
        cold = statistics.median(r["cold"]["ttft_s"] for r in cell)
        rows.append({"turn": turn + 1,
                     "context_tokens": round(statistics.mean(r["prompt_tokens"] for r in cell)),
                     "reused_tokens": round(statistics.mean(r["reuse"]["reused"] for r in cell)),
                     "ttft_s_cold": round(cold, 4), "ttft_s_reuse": round(reuse, 4),
                     "speedup": round(cold / reuse, 2)})
    return rows


def _plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [r["ttft_s_cold"] for r in rows], 0.4,
           label="--no-prefix-cache")
    ax.bar([i + 0.2 for i in x], [r["ttft_s_reuse"] for r in rows], 0.4, label="prefix reuse")
    ax.set_xticks(x, [f"{r['turn']}\n{r['context_tokens']:,}" for r in rows])
    ax.set_xlabel("turn / context tokens")
    ax.set_ylabel("TTFT, median over conversations (s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = _args()
    kwargs = engine_kwargs(args) | model_kwargs(args)
    llm = LLM(args.model, progress=False, **kwargs | {"prefix_cache": True})
    cache = llm.runner.prefix

    def run(mode: str, ids: list[int], answer: int) -> dict:
        llm.runner.prefix = cache if mode == "reuse" else None
        try:
            return _run(llm, ids, answer)
        finally:
            llm.runner.prefix = cache
    rng = random.Random(args.seed)
    vocab = llm.model_config.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, vocab // 2) for _ in range(n)]

    for mode in ("reuse", "cold"):  # warm-up, not counted
        run(mode, [2] + ids(64), 2)
    exact = llm.config.device == "cpu"
    matches = []
    context = [[2] + ids(args.first - 1) for _ in range(args.conversations)]
    requests, start = [], time.perf_counter()
    for turn in range(args.turns):
        for conv in range(args.conversations):
            order = ("reuse", "cold") if (turn + conv) % 2 else ("cold", "reuse")
            row = {"conversation": conv, "turn": turn, "prompt_tokens": len(context[conv])}
            for mode in order:
                row[mode] = run(mode, context[conv], args.answer)
            a, b = row["reuse"]["token_ids"], row["cold"]["token_ids"]
            assert a == b or not exact, (conv, turn)
            row["first_difference"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                           None)
            matches.append(sum(x == y for x, y in zip(a, b)) / len(a))
            context[conv] += row["reuse"].pop("token_ids") + ids(args.append)
            del row["cold"]["token_ids"]
            requests.append(row)
        print(f"turn {turn + 1}: {_summary(requests, turn + 1)[-1]}", file=sys.stderr,
              flush=True)
    rows = _summary(requests, args.turns)
    c = llm.config
    receipt = {
        "benchmark": "multi-turn chat, TTFT per turn with and without prefix reuse",
        "device": c.device, "dtype": c.dtype, "kv_dtype": c.kv_dtype,
        "model": llm.model_config.architecture + (f" {args.model_config} (dummy)" if
                                                   args.load_format == "dummy" else
                                                   f" {Path(llm.path).name}"),
        "machine": torch.cuda.get_device_name() if c.device == "cuda" else platform.processor()
        or platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "scale": {k: getattr(args, k) for k in ("conversations", "turns", "first", "append",
                                                 "answer", "seed")},
        "page_size": c.page_size, "prefix_cache_gb": c.prefix_cache_gb,
        "same_tokens": all(r["first_difference"] is None for r in requests),
        "token_match_fraction": round(statistics.mean(matches), 4),
        "requests_with_a_difference": sum(r["first_difference"] is not None for r in requests),
        "wall_s": round(time.perf_counter() - start, 1),
        "prefix_cache": dataclasses.asdict(llm.runner.prefix.stats()),
        "turns": rows, "requests": requests,
    }
    last = rows[-1]
    print(f"prefix reuse: turn {last['turn']} at {last['context_tokens']} tokens TTFT "
          f"{last['ttft_s_cold']:.3f} s cold -> {last['ttft_s_reuse']:.3f} s "
          f"({last['speedup']}x); {receipt['requests_with_a_difference']} of {len(requests)} "
          f"requests with a token difference")
    if args.out:
        args.out.write_text(json.dumps(receipt, indent=1) + "\n")
    if args.plot:
        _plot(rows, f"{receipt['model']}, {c.device}: {args.conversations} conversations x "
              f"{args.turns} turns, +{args.answer + args.append} tokens a turn", args.plot)


if __name__ == "__main__":
    main()
