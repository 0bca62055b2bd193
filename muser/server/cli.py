"""`muser serve`: load the model, then serve it over HTTP with uvicorn."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

from muser.engine_args import add_engine_args, engine_kwargs, positive_int
from muser.errors import MuserError
from muser.server.options import add_options, server_options


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over HTTP (OpenAI and llama.cpp routes)",
                       description="Serve a model: OpenAI-compatible /v1/* routes and "
                       "llama.cpp-compatible ones, with continuous batching.")
    add_engine_args(p)
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
    p.add_argument("--model-name", metavar="NAME[,ALIAS...]", help="name clients use, then "
                   "other names it answers to (default: the model file's stem)")
    p.add_argument("--max-body-bytes", type=positive_int, default=4 << 20,
                   help="largest request body (default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds SIGTERM waits for in-flight requests (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from muser.disagg.cli import add_serve_args

    add_serve_args(p)
    add_options(p)
    p.set_defaults(run=serve)


def _keys(args: argparse.Namespace):
    from muser.server.auth import Keys, read_key_file

    api = list(args.api_key) + (read_key_file(args.api_key_file) if args.api_key_file else [])
    if any(not k for k in api + list(args.admin_key)):
        raise MuserError("API keys must be non-empty")
    return Keys(tuple(api), tuple(args.admin_key))


def _load_kwargs(args: argparse.Namespace) -> dict:
    """--load-format dummy (random weights of --model-config) where the engine flags offer it."""
    if getattr(args, "load_format", "auto") == "auto":
        return {}
    return {"load_format": args.load_format, "model_config": args.model_config}


def serve(args: argparse.Namespace) -> int:
    """Bind at once, load and warm the engine in its own process (503 until ready), serve."""
    import uvicorn

    from muser.server.app import create_app
    from muser.server.loop_stats import LoopStats
    from muser.server.metrics import Metrics
    from muser.server.startup import Startup

    keys = _keys(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    holder: list[uvicorn.Server] = []

    def stop(exc: BaseException) -> None:
        logging.getLogger("muser.server").error("startup failed: %s", exc)
        holder[0].should_exit = True

    startup = Startup(lambda: _context(args, keys, metrics), stop)
    metrics = Metrics(lambda: startup.ctx.loop.stats if startup.ctx else LoopStats())
    config = uvicorn.Config(create_app(startup, metrics), host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout,
                            server_header=False)
    holder.append(uvicorn.Server(config))
    hosts = [h.strip().strip("[]") for h in args.host.split(",") if h.strip()]
    holder[0].run(sockets=[_bind(h, args.port) for h in hosts] if len(hosts) > 1 else None)
    if startup.error is not None:
        raise startup.error if isinstance(startup.error, MuserError) else MuserError(
            f"startup failed: {startup.error}")
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to one of several --host addresses (IPv6 ones IPv6 only)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise MuserError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    return sock


def _context(args: argparse.Namespace, keys, metrics):
    """Start the engine process, wait until it has loaded and warmed the model up (phases
    logged by it) -> the routes' context."""
    from muser.server.context import ServerContext
    from muser.server.engine_process import EngineProcess, EngineSpec

    kwargs = engine_kwargs(args)
    kwargs.update(max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                  decode_waiting_chunk=args.decode_waiting_chunk, **_load_kwargs(args))
    if args.chunk_policy == "fixed":
        kwargs["decode_waiting_chunk"] = kwargs["prefill_chunk"]
    from muser.disagg.cli import disagg_options

    options = server_options(args)
    spec = EngineSpec(args.model, kwargs, args.log_level, sys.stderr.isatty(),
                      disagg_options(args), options.slot_save_path, options.grammar_limits)
    loop = EngineProcess(spec, args.max_queue)
    ready = loop.launch()
    return ServerContext(loop, ready.tokenizer, metrics, keys,
                         args.model_name or Path(ready.model_path).stem, ready.model_path,
                         ready.max_model_len, ready.max_num_seqs, args.max_body_bytes,
                         batching=ready.batching, options=options)
