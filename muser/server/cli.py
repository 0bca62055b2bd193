"""`muser serve` (its flags: muser/server/serve_args.py): load the model in the engine process,
serve it over HTTP with uvicorn."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

import uvicorn

from muser.disagg.cli import disagg_options
from muser.engine_args import engine_kwargs
from muser.errors import MuserError
from muser.server.app import create_app
from muser.server.auth import Keys, read_key_file
from muser.server.context import ServerContext
from muser.server.engine_process import EngineProcess, EngineSpec
from muser.server.loop_stats import LoopStats
from muser.server.metrics import Metrics
from muser.server.options import server_options
from muser.server.startup import Startup


def _keys(args: argparse.Namespace) -> Keys:
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
    keys = _keys(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    holder: list[uvicorn.Server] = []

    def stop(exc: BaseException) -> None:
        logging.getLogger("muser.server").error("startup failed: %s", exc)
        holder[0].should_exit = True

    startup = Startup(lambda: _context(args, keys, metrics), stop)
    metrics = Metrics(lambda: startup.ctx.loop.stats if startup.ctx else LoopStats())
    config = uvicorn.Config(create_app(startup, metrics, args.sleep_idle_seconds),
                            host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout,
                            server_header=False)
    holder.append(uvicorn.Server(config))
    hosts = [h.strip().strip("[]") for h in args.host.split(",") if h.strip()]
    holder[0].run(sockets=[_bind(h, args.port) for h in hosts] if len(hosts) > 1 else None)
    if startup.error is not None:
        raise startup.error if isinstance(startup.error, MuserError) else MuserError(
            f"startup failed: {startup.error}")
    return 0


def model_names(args: argparse.Namespace) -> str | None:
    """--model-name as given, or --alias's names in alphabetical order (llama-server's id is
    the first of them) -> 'name[,alias...]', or None (the model file's stem)."""
    if args.alias is None:
        return args.model_name
    return ",".join(sorted({n.strip() for n in args.alias.split(",") if n.strip()}))


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
    kwargs = engine_kwargs(args)
    kwargs.update(max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                  decode_waiting_chunk=args.decode_waiting_chunk, **_load_kwargs(args))
    if args.chunk_policy == "fixed":
        kwargs["decode_waiting_chunk"] = kwargs["prefill_chunk"]
    options = server_options(args)
    spec = EngineSpec(args.model, kwargs, args.log_level, sys.stderr.isatty(),
                      disagg_options(args), options.slot_save_path, options.grammar_limits)
    loop = EngineProcess(spec, args.max_queue)
    ready = loop.launch()
    return ServerContext(loop, ready.tokenizer, metrics, keys,
                         model_names(args) or Path(ready.model_path).stem, ready.model_path,
                         ready.max_model_len, ready.max_num_seqs, args.max_body_bytes,
                         ready.hidden_size, args.context_shift, batching=ready.batching,
                         options=options)
