"""Sampled decoding on the CPU, top-p lists shortened (muser/sampler.py `_top_p_prefix`) against
the whole vocabulary sorted for every top-p row (the path before it), side by side in one
process: the TPOT of `LLM.generate` on the embedded model, per sampling setting.

    python bench/sampler_cpu.py --out bench/results/sampler_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
from pathlib import Path

import torch

from muser import sampler
from muser.core import SamplingParams
from muser.llm import LLM

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8, top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature 1.0, top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "temperature 0.8, top-k 40, top-p 0.95": {"temperature": 0.8, "top_k": 40, "top_p": 0.95},
    "temperature 0.8": {"temperature": 0.8},
}
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def ms_per_token(llm: LLM, params: SamplingParams) -> tuple[float, list[int]]:
    """TPOT of one request (the sampler runs once per decode step) and its tokens."""
    out = llm.generate(PROMPT, params)
    return out.tpot_s * 1e3, out.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    llm = LLM()
    shortened = sampler._top_p_prefix
    whole = lambda row, top_p: (row.numel(), math.nan)  # the whole vocabulary, sorted
    cells = []
    for name, kwargs in SETTINGS.items():
        params = SamplingParams(max_tokens=args.tokens, seed=1, **kwargs)
        llm.generate(PROMPT, SamplingParams(max_tokens=4, seed=1, **kwargs))  # warm
        times = {"shortened": [], "whole": []}
        tokens = {}
        for _ in range(args.reps):  # interleaved, so drift hits both alike
            for label, fn in (("whole", whole), ("shortened", shortened)):
                sampler._top_p_prefix = fn
                ms, tokens[label] = ms_per_token(llm, params)
                times[label].append(ms)
        sampler._top_p_prefix = shortened
        cell = {"setting": name, "params": kwargs, "tokens": args.tokens,
                "ms_per_token": statistics.median(times["shortened"]),
                "ms_per_token_whole_sort": statistics.median(times["whole"]),
                "samples_ms": times, "same_tokens": tokens["shortened"] == tokens["whole"]}
        cell["speedup"] = cell["ms_per_token_whole_sort"] / cell["ms_per_token"]
        print(f"{name:40s} {cell['ms_per_token']:7.2f} ms/token against "
              f"{cell['ms_per_token_whole_sort']:7.2f} ({cell['speedup']:.2f}x), same tokens "
              f"{cell['same_tokens']}", flush=True)
        cells.append(cell)
    receipt = {"machine": platform.processor() or platform.machine(), "threads":
               torch.get_num_threads(), "torch": torch.__version__, "cells": cells}
    args.out.write_text(json.dumps(receipt, indent=1) + "\n")


if __name__ == "__main__":
    main()
