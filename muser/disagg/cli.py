"""`muser prefill-worker`'s flags (its work is muser/disagg/worker_cli.py, loaded when it runs)
and the serving node's disaggregation flags: torch-free, as the HTTP process reads them."""

from __future__ import annotations

import argparse

from muser.disagg.address import parse_address
from muser.engine_args import add_engine_args
from muser.errors import MuserError


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
    p.set_defaults(run="muser.disagg.worker_cli:run")


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
