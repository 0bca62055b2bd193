"""`muser prefill-worker`: load the model, then serve prefill requests (muser/disagg/worker.py)
until interrupted."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from muser.disagg.address import parse_address
from muser.disagg.wire import Listener, check_backend
from muser.disagg.worker import run as serve_prefills
from muser.engine_args import engine_kwargs, model_kwargs
from muser.errors import MuserError
from muser.llm import LLM
from muser.startup import StartupLog


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("muser.disagg")
    try:
        host, port = parse_address(args.listen)
    except ValueError as exc:
        raise MuserError(f"--listen: {exc}") from None
    kwargs = engine_kwargs(args)
    check_backend(args.backend, torch.device(kwargs.get("device") or (
        "cuda" if torch.cuda.is_available() else "cpu")))
    llm = LLM(args.model, progress=sys.stderr.isatty(),
              log=StartupLog(logging.getLogger("muser.startup").info),
              **(model_kwargs(args) if args.load_format == "dummy" else {}),
              **(kwargs | {"prefix_cache": False}), max_num_seqs=1)  # NOTE: fresh sequences only
    print_ = llm.fingerprint()
    listener = Listener(host, port, args.backend, args.timeout, llm.runner.device)
    log.info("prefill worker ready on %s:%d (model %s, fingerprint %s)", host, port, llm.path,
             print_)
    try:
        serve_prefills(llm, listener, print_)
    except KeyboardInterrupt:
        return 0
    return 0
