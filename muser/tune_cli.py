"""`muser tune`: fill this machine's tuning cache ahead of time, so that `muser serve` and `LLM`
start from stored picks (each model is loaded and warmed up exactly as serving would be)."""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from muser.engine_args import add_engine_args, engine_kwargs, positive_int
from muser.errors import MuserError
from muser.llm import LLM
from muser.startup import StartupLog


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
    p.set_defaults(run=tune)


def tune(args: argparse.Namespace) -> int:
    kwargs = engine_kwargs(args)
    if kwargs.setdefault("device", "cuda") != "cuda":
        raise MuserError("muser tune measures GPU kernels: it needs --device cuda")
    models = [("dummy", p) for p in args.preset] or [
        ("dummy", args.model_config) if args.load_format == "dummy" or not args.model
        else ("auto", None)]
    report = {}
    bar = tqdm(models, desc="tune", unit="model", file=sys.stderr)
    for load_format, name in bar:
        label = name or args.model
        bar.set_postfix_str(label)
        log = StartupLog(lambda line, label=label: tqdm.write(f"{label}: {line}", sys.stderr))
        llm = LLM(args.model if load_format == "auto" else None, progress=False,
                  load_format=load_format, model_config=name, max_num_seqs=args.max_num_seqs,
                  log=log, **kwargs)
        report[label] = {"phases_s": log.phases, "details": dict(llm.runner.startup.phases)}
        del llm
    if args.json:
        print(json.dumps(report, indent=1))
    return 0
