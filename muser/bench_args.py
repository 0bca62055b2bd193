"""`muser bench`'s flags (the work is muser/bench.py, loaded when the subcommand runs)."""

from __future__ import annotations

import argparse

from muser.engine_args import add_engine_args


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure prefill and decode tokens/s (JSON receipt)",
                       description="Prefill tokens/s per prompt length and decode tokens/s, "
                       "median of --repeats runs. When llama-cpp-python is installed, llama.cpp "
                       "runs the same GGUF file in the same process and each cell gets a ratio.")
    add_engine_args(p)
    p.add_argument("--prompt-lengths", default="32,128,512,2048",
                   help="comma-separated prefill lengths (default: %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=128, help="decode steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is kept")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp baseline")
    p.add_argument("--out", metavar="FILE", help="write the JSON receipt here")
    p.set_defaults(run="muser.bench:run")
