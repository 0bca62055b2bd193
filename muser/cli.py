"""`muser` command line: generate | bench | tune | prefill-worker | serve.

Building the parser imports no torch (`muser --help`, and the HTTP process of `muser serve`,
which never loads it): each subcommand's flags live in a torch-free module, and its work is
named as "module:function" (`run` on the parsed arguments), imported by `main` when that
subcommand runs."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from muser.bench_args import add_bench_parser
from muser.disagg.cli import add_worker_parser
from muser.engine_args import (
    add_decode_args,
    add_engine_args,
    engine_kwargs,
    non_negative,
    positive_int,
    unit_interval,
)
from muser.errors import MuserError
from muser.server.serve_args import add_serve_parser
from muser.tune_args import add_tune_parser

__all__ = ["build_parser", "engine_kwargs", "main"]

_SERVER_EXTRA = ("fastapi", "starlette", "uvicorn", "prometheus_client")  # muser[server]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muser", description="An inference engine for "
                                     "hybrid-attention LLMs (Gemma 3).")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout",
                         description="Generate text. The prompt comes from PROMPT, --prompt-file "
                         "or stdin; it is tokenized with BOS and special tokens parsed.")
    gen.add_argument("prompt", nargs="?", metavar="PROMPT")
    gen.add_argument("--prompt-file", metavar="F", help="read the prompt from file F")
    add_engine_args(gen)
    add_decode_args(gen)
    gen.add_argument("--max-tokens", type=positive_int, default=128,
                     help="most new tokens (default: %(default)s)")
    gen.add_argument("--temperature", type=non_negative(float), default=0.0,
                     help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-k", type=non_negative(int), default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    gen.add_argument("--min-p", type=unit_interval, default=0.0, help="0 = off")
    gen.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, help="same seed, same text")
    gen.add_argument("--stop", action="append", default=[], metavar="S",
                     help="stop when S is generated (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-turn")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (ids, text, timings) instead of streaming")
    gen.set_defaults(run="muser.generate:run")
    add_bench_parser(sub)
    add_tune_parser(sub)
    add_worker_parser(sub)
    add_serve_parser(sub)
    return parser


def _work(run: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand's work from its "module:function" name. NOTE: the command line's one lazy
    import: the module (the engine, torch, or the server's extra) loads only when it runs."""
    module, _, function = run.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except ImportError as exc:
        if module == "muser.server.cli" and exc.name in _SERVER_EXTRA:
            raise MuserError(f"muser serve needs the [server] extra ({exc.name} is not "
                             "installed): pip install 'muser[server]'") from None
        raise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _work(args.run)(args)
    except MuserError as exc:
        print(f"muser: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
