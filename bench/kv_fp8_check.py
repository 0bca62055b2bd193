"""The FP8 KV cache (`--kv-cache-dtype fp8`) against bfloat16 KV on one GPU, as JSON: accuracy,
capacity and decode time at depth, per preset (seeded dummy weights: `--load-format dummy`,
muser/presets.py through muser.graph.weights.random_weights, the same draws for both caches).

Per preset, one engine with a bfloat16 cache, then one with an FP8 cache (one at a time: a
27B's weights take most of an H100), each started as `muser serve` starts one (warm-up, pages
sized from the memory left at --gpu-memory-utilization, decode graphs):

- accuracy: a seeded prompt of --prompt tokens, then --steps greedy steps on the bfloat16
  cache; the FP8 engine is fed the same tokens (teacher-forced): max |delta logit| over every
  step's logits, greedy agreement (steps whose FP8 argmax is the bfloat16 token) and the first
  step where they differ (where free-running greedy decoding would part);
- capacity: the bytes a token costs in the global layers' pages (K and V of every global layer,
  from the pool's own tensors) and in a ring, and the tokens --kv-budget-gb of pages holds (the
  pages the startup sized are capped at max_num_seqs full-length sequences, one here, so their
  count says nothing of capacity);
- depth: TPOT of --decode tokens after a prompt of each --depths (one sequence, prefix cache
  off), skipped past the preset's context (gemma3-1b holds 32,768).

The receipt is written after every cell, so a run cut short keeps what it measured.

    python3 bench/kv_fp8_check.py --out $OUT                       # both presets, ~4 min
    python3 bench/kv_fp8_check.py --presets gemma3-1b --depths 32768 --out /tmp/kv
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muser import LLM, SamplingParams
from muser.presets import preset

KV_DTYPES = ("bfloat16", "fp8")
LOG: list[str] = []


def say(line: str) -> None:
    LOG.append(line)
    print(line, file=sys.stderr, flush=True)


def seeded_ids(n: int, vocab: int, seed: int) -> list[int]:
    """n token ids away from the vocabulary's ends (special tokens), seeded."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()


def agreement(ref_tokens: list[int], ref_logits: torch.Tensor,
              logits: torch.Tensor) -> dict:
    """The bfloat16 run's greedy tokens and logits [steps, vocab] against another cache's
    logits for the same inputs -> max |delta logit|, steps agreeing, the first that does not."""
    assert ref_logits.shape == logits.shape and len(ref_tokens) == logits.shape[0]
    picked = logits.argmax(-1).tolist()
    same = [a == b for a, b in zip(picked, ref_tokens, strict=True)]
    return {"max_abs_dlogit": float((logits - ref_logits).abs().max()),
            "mean_abs_dlogit": float((logits - ref_logits).abs().mean()),
            "greedy_agree": sum(same), "steps": len(same),
            "first_disagreement": same.index(False) if False in same else None}


def teacher_forced(llm: LLM, prompt: list[int], tokens: list[int] | None,
                   steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt`, then `steps` decode steps fed `tokens` (None: greedy, each step's own
    argmax) -> (each step's token, the logits before it [steps, vocab] float32 on the host)."""
    runner = llm.runner
    seq = runner.allocate()
    try:
        rows = [runner.forward([seq], [prompt])[-1:].float().cpu()]
        fed = []
        for i in range(steps):
            fed.append(int(rows[-1][-1].argmax()) if tokens is None else tokens[i])
            if i + 1 < steps:
                rows.append(runner.forward([seq], [[fed[-1]]])[-1:].float().cpu())
        return fed, torch.cat(rows)
    finally:
        runner.free(seq)


def capacity(llm: LLM, budget_bytes: int) -> dict:
    """What a token costs in the global layers' pages and in a ring (from the pool's tensors),
    and the tokens `budget_bytes` of pages hold."""
    pool, cfg = llm.runner.pool, llm.model_config
    page_token = pool.page_nbytes // pool.page_size
    ring_token = pool.rings[:, :, 0, 0].nbytes
    return {"bytes_per_token_global": page_token, "bytes_per_token_sliding": ring_token,
            "kv_budget_bytes": budget_bytes, "tokens_at_budget": budget_bytes // page_token,
            "num_pages": pool.num_pages, "page_size": pool.page_size,
            "kv_pages_bytes": pool.pages.nbytes, "kv_sliding_bytes": pool.rings.nbytes,
            "global_layers": len(cfg.layers_of("global"))}


def depth_cells(llm: LLM, depths: list[int], decode: int) -> list[dict]:
    cfg, cells = llm.model_config, []
    greedy = SamplingParams(max_tokens=decode + 1, ignore_eos=True)
    warm = min(512, llm.config.max_model_len - decode - 1)
    llm.generate(seeded_ids(warm, cfg.vocab_size, 2), greedy)  # the decode graphs replayed once
    for depth in depths:
        start = time.perf_counter()
        r = llm.generate(seeded_ids(depth, cfg.vocab_size, 3), greedy)
        cells.append({"depth": depth, "tpot_ms": r.tpot_s * 1e3, "ttft_s": r.ttft_s,
                      "wall_s": time.perf_counter() - start})
        say(f"  depth {depth}: TPOT {r.tpot_s * 1e3:.2f} ms (TTFT {r.ttft_s:.2f} s)")
    return cells


def one_engine(name: str, kv: str, args, depths: list[int],
               ref: dict | None) -> tuple[dict, dict]:
    """One engine of `kv` cache: its cell, and the bfloat16 reference (made here if None)."""
    start = time.perf_counter()
    want = max([*depths, args.prompt + args.steps]) + args.decode + 1
    llm = LLM(None, load_format="dummy", model_config=name, kv_cache_dtype=kv,
              max_num_seqs=1, prefix_cache=False, progress=False,
              max_model_len=min(want, preset(name).max_position_embeddings),
              gpu_memory_utilization=args.gpu_memory_utilization, device=args.device)
    cell = {"model": name, "kv_dtype": kv, "startup_s": time.perf_counter() - start,
            **capacity(llm, int(args.kv_budget_gb * 2**30))}
    say(f"{name} {kv}: {cell['bytes_per_token_global']} B a token in the global layers: "
        f"{cell['tokens_at_budget']} tokens in {args.kv_budget_gb} GiB")
    prompt = seeded_ids(args.prompt, llm.model_config.vocab_size, 1)
    tokens, logits = teacher_forced(llm, prompt, None if ref is None else ref["tokens"],
                                    args.steps)
    if ref is None:
        cell["greedy_tokens"] = tokens
        ref = {"tokens": tokens, "logits": logits}
    else:
        cell |= agreement(ref["tokens"], ref["logits"], logits)
        say(f"  max |dlogit| {cell['max_abs_dlogit']:.4f}, greedy "
            f"{cell['greedy_agree']}/{cell['steps']}")
    cell["depths"] = depth_cells(llm, depths, args.decode)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return cell, ref


def ratios(cells: list[dict]) -> dict:
    """fp8 / bfloat16 of one preset's two cells: tokens at the budget, TPOT per shared depth."""
    by = {c["kv_dtype"]: c for c in cells}
    if set(by) != set(KV_DTYPES):
        return {}
    bf, f8 = by["bfloat16"], by["fp8"]
    tpot = {d["depth"]: d["tpot_ms"] for d in bf["depths"]}
    return {"tokens_fp8_over_bf16": f8["tokens_at_budget"] / bf["tokens_at_budget"],
            "tpot_fp8_over_bf16": {str(d["depth"]): d["tpot_ms"] / tpot[d["depth"]]
                                   for d in f8["depths"] if d["depth"] in tpot}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="gemma3-1b,gemma3-27b")
    p.add_argument("--depths", default="32768,131000",
                   help="TPOT depths (prompt tokens; 131,000 + the decode steps fit 131,072)")
    p.add_argument("--prompt", type=int, default=512, help="accuracy prompt tokens")
    p.add_argument("--steps", type=int, default=64, help="greedy steps compared")
    p.add_argument("--decode", type=int, default=32, help="decode steps timed at each depth")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-budget-gb", type=float, default=16.0,
                   help="GiB of pages the capacity cells count tokens in")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="directory of kv_fp8_check.json (default: $OUT, else here)")
    args = p.parse_args()
    out = Path(args.out) / "kv_fp8_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    receipt = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "args": vars(args), "presets": {}, "log": LOG}
    for name in args.presets.split(","):
        limit = preset(name).max_position_embeddings
        depths = [int(d) for d in args.depths.split(",")]
        for d in [d for d in depths if d + args.decode + 1 > limit]:
            say(f"{name}: depth {d} skipped: its context holds {limit}")
        depths = [d for d in depths if d + args.decode + 1 <= limit]
        cells, ref = [], None
        receipt["presets"][name] = {"cells": cells}
        for kv in KV_DTYPES:
            cell, ref = one_engine(name, kv, args, depths, ref)
            cells.append(cell)
            receipt["presets"][name]["ratios"] = ratios(cells)
            out.write_text(json.dumps(receipt, indent=1))
    print(json.dumps({n: r["ratios"] for n, r in receipt["presets"].items()}))


if __name__ == "__main__":
    main()
