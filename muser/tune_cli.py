"""`muser tune`: fill this machine's tuning cache ahead of time, so that `muser serve` and `LLM`
start from stored picks (each model is loaded and warmed up exactly as serving would be)."""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from muser.engine_args import engine_kwargs
from muser.errors import MuserError
from muser.llm import LLM
from muser.startup import StartupLog


def run(args: argparse.Namespace) -> int:
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
