"""`muser prefill-worker` and the serving node's disaggregation flags."""

from __future__ import annotations

import argparse
import logging
import sys

from muser.engine_args import add_engine_args, engine_kwargs, model_kwargs


def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill-worker", help="prefill prompts for a serving node (`muser serve "
                       "--prefill-worker`) and send back their KV",
                       description="Load the model and serve prefill requests over "
                       "torch.distributed: each prompt is prefilled here and its KV (every "
                       "layer) and first-token logits go back to the serving node, which "
                       "verifies and installs them.")
    add_engine_args(p)
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="address of this worker's rendezvous store (the serving node connects)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="gloo: TCP between hosts (CPU tensors; a GPU's KV is staged through "
                   "host memory); nccl: GPU to GPU (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a transfer may take before the link is dropped "
                   "(default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=run_worker)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-worker", action="append", default=[], metavar="HOST:PORT",
                   help="a `muser prefill-worker` to send long prompts to (repeatable)")
    p.add_argument("--disagg-min-tokens", default="auto", metavar="N|auto",
                   help="prompts of at least N tokens go to a prefill worker, shorter ones "
                   "stay local; auto: the crossover measured at startup (local prefill time "
                   "against a remote round trip at a few lengths) (default: %(default)s)")
    p.add_argument("--disagg-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a remote prefill may take before the prompt is prefilled "
                   "locally (default: %(default)s)")
    p.add_argument("--disagg-backend", choices=["gloo", "nccl"], default="gloo",
                   help="the workers' transport (default: %(default)s)")


def disagg_options(args: argparse.Namespace) -> dict | None:
    """The serving node's disaggregation settings, or None without workers."""
    from muser.disagg.wire import parse_address
    from muser.errors import MuserError

    if not args.prefill_worker:
        return None
    try:
        for address in args.prefill_worker:
            parse_address(address)
        min_tokens = (None if args.disagg_min_tokens == "auto"
                      else int(args.disagg_min_tokens))
    except ValueError as exc:
        raise MuserError(f"--prefill-worker / --disagg-min-tokens: {exc}") from None
    if min_tokens is not None and min_tokens < 1:
        raise MuserError("--disagg-min-tokens must be >= 1 or auto")
    return {"workers": list(args.prefill_worker), "min_tokens": min_tokens,
            "timeout_s": args.disagg_timeout, "backend": args.disagg_backend}


def run_worker(args: argparse.Namespace) -> int:
    import torch

    from muser import LLM
    from muser.disagg.wire import Listener, check_backend, parse_address
    from muser.disagg.worker import run
    from muser.errors import MuserError
    from muser.startup import StartupLog

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
        run(llm, listener, print_)
    except KeyboardInterrupt:
        return 0
    return 0
