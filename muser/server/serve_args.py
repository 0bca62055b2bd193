"""`muser serve`'s flags. The work (muser/server/cli.py, with the [server] extra) loads when the
subcommand runs; neither imports torch (the engine runs in its own process)."""

from __future__ import annotations

import argparse

from muser.disagg.cli import add_serve_args
from muser.engine_args import add_decode_args, add_engine_args, positive_int
from muser.server.options import add_options


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over HTTP (OpenAI and llama.cpp routes)",
                       description="Serve a model: OpenAI-compatible /v1/* routes and "
                       "llama.cpp-compatible ones, with continuous batching.")
    add_engine_args(p)
    add_decode_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address, or several separated by "
                   "commas, e.g. 127.0.0.1,::1 (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="default: %(default)s")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept KEY on every route but /health (repeatable)")
    p.add_argument("--api-key-file", metavar="F", help="file with one API key per line")
    p.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                   help="key for admin routes (/slots); also works as an API key")
    p.add_argument("--max-num-seqs", type=positive_int,
                   help="sequences in flight, decoded together (default: 32 on the GPU, 8 on "
                   "the CPU)")
    p.add_argument("--max-batched-tokens", type=positive_int,
                   help="most rows one step computes, decode rows first, then prefill rows of "
                   "one or more prompts; at least --max-num-seqs (default: 2048 on the GPU, "
                   "512 on the CPU)")
    p.add_argument("--decode-waiting-chunk", type=positive_int,
                   help="most prefill rows in a step while any sequence decodes: running "
                   "streams' TPOT vs new prompts' TTFT (default on the GPU: measured at "
                   "startup, the largest cap whose mixed step takes at most 2x the decode "
                   "step; 64 on the CPU)")
    p.add_argument("--max-queue", type=positive_int, default=64,
                   help="requests waiting beyond --max-num-seqs before 429 (default: %(default)s)")
    p.add_argument("--chunk-policy", choices=["adaptive", "fixed"], default="adaptive",
                   help="adaptive: prefill rows are capped at --decode-waiting-chunk while "
                   "decodes run; fixed: full --prefill-chunk chunks regardless "
                   "(default: %(default)s)")
    names = p.add_mutually_exclusive_group()
    names.add_argument("--model-name", metavar="NAME[,ALIAS...]", help="name clients use, then "
                       "other names it answers to (default: the model file's stem)")
    names.add_argument("--alias", metavar="A[,B...]", help="llama-server's: the names the "
                       "model answers to, responses carrying the first in alphabetical order "
                       "(as llama-server picks it)")
    p.add_argument("--tags", metavar="T[,T...]", help="tags listed with the model in /v1/models "
                   "and /props (llama-server's)")
    p.add_argument("--max-body-bytes", type=positive_int, default=4 << 20,
                   help="largest request body (default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds SIGTERM waits for in-flight requests (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_serve_args(p)
    add_options(p)
    p.set_defaults(run="muser.server.cli:serve")
