"""Sampled decoding on the CPU, side by side in one process: the TPOT of `LLM.generate` on the
embedded model per sampling setting, for
- `before`: every top-p row sorts the whole vocabulary, and the draw runs as torch ops;
- `lists`: top-p lists shortened to their survivors (muser/sampler.py `_top_p_prefix`), its
  band sums and the draw as torch ops;
- `now`: shortened lists, their band sums in one C pass (muser/ops/native/bands.c) and the draw
  in one C pass (muser/ops/native/noise.c);
and, in the same process, `_top_p_prefix` alone on a vocabulary-wide row with the band sums as
torch ops and in C (`prefix_ms`).

    python bench/sampler_cpu.py --out bench/results/sampler_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from muser import sampler
from muser.core import SamplingParams
from muser.llm import LLM
from muser.ops import native

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8, top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature 1.0, top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "temperature 0.8, top-k 40, top-p 0.95": {"temperature": 0.8, "top_k": 40, "top_p": 0.95},
    "temperature 1.0 (the OpenAI API's default)": {"temperature": 1.0},
}
PROMPT = "Once upon a time, in a small village by the sea, there lived"


class TorchOps:
    """A stand-in for muser.ops.native in the sampler: the band sums and the draw as torch ops."""

    gumbel_argmax = staticmethod(sampler.gumbel_argmax)
    top_p_bands = staticmethod(sampler.top_p_bands)


VARIANTS = {  # (_top_p_prefix, the sampler's native module)
    "before": (lambda row, top_p: (row.numel(), math.nan), TorchOps),
    "lists": (sampler._top_p_prefix, TorchOps),
    "now": (sampler._top_p_prefix, native),
}


def tpot_ms(llm: LLM, params: SamplingParams) -> tuple[float, list[int]]:
    """TPOT of one request (the sampler runs once per decode step) and its tokens."""
    out = llm.generate(PROMPT, params)
    return out.tpot_s * 1e3, out.token_ids


def prefix_ms(vocab: int, reps: int = 200) -> dict:
    """Median ms of one `_top_p_prefix` call (top-p 0.95) on a random row of `vocab` logits
    (scale 3), band sums in torch and in C, interleaved; and whether both give the same list."""
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3
    times = {"torch": [], "native": []}
    results = {}
    for _ in range(reps):
        for label, ops in (("torch", TorchOps), ("native", native)):
            sampler.native = ops
            start = time.perf_counter()
            results[label] = sampler._top_p_prefix(row, 0.95)
            times[label].append((time.perf_counter() - start) * 1e3)
    sampler.native = native
    out = {f"{label}_ms": statistics.median(t) for label, t in times.items()}
    return {**out, "speedup": out["torch_ms"] / out["native_ms"], "list": results["native"][0],
            "same_result": results["torch"] == results["native"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    llm = LLM()
    one_row = prefix_ms(llm.model_config.vocab_size)
    print(f"_top_p_prefix: torch bands {one_row['torch_ms']:.3f} ms, C bands "
          f"{one_row['native_ms']:.3f} ms ({one_row['speedup']:.2f}x), "
          f"same {one_row['same_result']}", flush=True)
    cells = []
    for name, kwargs in SETTINGS.items():
        params = SamplingParams(max_tokens=args.tokens, seed=1, **kwargs)
        llm.generate(PROMPT, SamplingParams(max_tokens=4, seed=1, **kwargs))  # warm
        times = {label: [] for label in VARIANTS}
        tokens = {}
        for _ in range(args.reps):  # interleaved, so drift hits every variant alike
            for label, (prefix, draw) in VARIANTS.items():
                sampler._top_p_prefix, sampler.native = prefix, draw
                ms, tokens[label] = tpot_ms(llm, params)
                times[label].append(ms)
        sampler._top_p_prefix, sampler.native = VARIANTS["now"]
        cell = {"setting": name, "params": kwargs, "tokens": args.tokens,
                **{f"tpot_ms_{label}": statistics.median(t) for label, t in times.items()},
                "samples_ms": times,
                "same_tokens": all(t == tokens["before"] for t in tokens.values())}
        cell["speedup"] = cell["tpot_ms_before"] / cell["tpot_ms_now"]
        print(f"{name:44s} now {cell['tpot_ms_now']:6.2f} ms, lists "
              f"{cell['tpot_ms_lists']:6.2f}, before {cell['tpot_ms_before']:6.2f} "
              f"({cell['speedup']:.2f}x), same tokens {cell['same_tokens']}", flush=True)
        cells.append(cell)
    receipt = {"machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "prefix_ms": one_row,
               "cells": cells}
    args.out.write_text(json.dumps(receipt, indent=1) + "\n")


if __name__ == "__main__":
    main()
