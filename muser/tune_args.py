"""`muser tune`'s flags (the work is muser/tune_cli.py, loaded when the subcommand runs)."""

from __future__ import annotations

import argparse

from muser.engine_args import add_engine_args, positive_int


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="measure kernel picks ahead of time (GPU)",
                       description="Warm up each model as serving would (compile every kernel, "
                       "time every projection shape, capture the decode graphs) and store the "
                       "picks in the tuning cache under the cache directory.")
    add_engine_args(p)
    p.add_argument("--preset", action="append", default=[], metavar="NAME",
                   help="tune a named shape with dummy weights, e.g. gemma3-1b (repeatable; "
                   "default: --model, or --model-config)")
    p.add_argument("--max-num-seqs", type=positive_int,
                   help="largest decode batch to tune, as `muser serve --max-num-seqs` "
                   "(default: the GPU's serving default, 32)")
    p.add_argument("--json", action="store_true", help="print what each phase did as JSON")
    p.set_defaults(run="muser.tune_cli:run")
