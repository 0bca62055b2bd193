"""ServerOptions: the `muser serve` switches the routes read (CORS, model names, defaults...)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from muser.constraint import GrammarLimits
from muser.core import POOLINGS
from muser.errors import MuserError


@dataclass(frozen=True)
class Defaults:
    """Server-side sampling defaults, used where a request leaves the field out (None: the
    route's own default)."""

    n_predict: int | None = None
    temperature: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class ServerOptions:
    strict_model_name: bool = False
    cors_origins: tuple[str, ...] = ("localhost",)
    metrics: bool = True
    slots: bool = True
    chat_template: str | None = None  # Jinja source overriding the GGUF's
    slot_save_path: str | None = None  # the folder of slot files (resolved; None: no files)
    verbose: bool = False  # every chat reply carries __verbose (llama-server's --verbose)
    thinking: bool = True  # chat templates' enable_thinking (--reasoning off: False)
    defaults: Defaults = Defaults()
    max_n: int = 8  # most samples (n, best_of) one request may ask for
    keyless_admin: bool = False  # slot save / restore / erase without --admin-key
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    tags: tuple[str, ...] = ()  # listed with the model (llama-server's --tags)
    sleep_idle_s: float | None = None  # stop the engine after this long idle (None: never)
    pooling: str | None = None  # --embedding's --pooling (None: the embedding routes say 501)
    tool_call_parser: str | None = None  # the tool format (None: from the chat template)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to a request naming another model (default: a server with "
                   "one model serves it whatever name a request gives)")
    p.add_argument("--cors-origins", default="localhost", metavar="LIST",
                   help="comma-separated origins browsers may call from; 'localhost' stands for "
                   "any http(s) origin on localhost, 127.0.0.1 or [::1], '*' for any "
                   "(default: %(default)s)")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="serve /metrics (default: on)")
    p.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                   help="serve /slots (default: on)")
    p.add_argument("--chat-template", metavar="JINJA",
                   help="Jinja chat template replacing the GGUF's tokenizer.chat_template")
    p.add_argument("--chat-template-file", metavar="F", help="--chat-template read from F")
    p.add_argument("--max-n", type=int, default=8, metavar="N",
                   help="most samples one request may ask for with n / best_of; each takes a "
                   "sequence slot, so at most --max-num-seqs (default: %(default)s)")
    p.add_argument("--verbose", action="store_true",
                   help="every chat completion carries __verbose (the rendered prompt), as "
                   "llama-server's --verbose makes it; a request's \"verbose\" asks the same")
    p.add_argument("--reasoning", choices=["on", "off", "auto"], default="auto",
                   help="off: chat templates render with enable_thinking false, and a thinking "
                   "block a template opens anyway is closed (default: %(default)s, as on)")
    p.add_argument("--tool-call-parser", choices=["json", "gemma4"],
                   help="the tool-call format of chat replies: json (functions described in "
                   "the system turn, calls as JSON objects: Gemma 3's convention) or gemma4 "
                   "(Gemma 4's native <|tool_call> syntax and thinking channel) (default: "
                   "gemma4 when the chat template has <|tool_call>, else json)")
    p.add_argument("--slot-save-path", metavar="DIR",
                   help="folder for POST /slots/{id}?action=save|restore (slot KV files; "
                   "created if missing; default: save and restore are off)")
    p.add_argument("--keyless-admin", action="store_true",
                   help="let a server without --admin-key run POST /slots/{id}?action=save|"
                   "restore|erase: anyone who can reach the port may then write, read back and "
                   "erase slot files and cancel requests (default: those routes answer 403 "
                   "until --admin-key is given)")
    g = GrammarLimits()
    p.add_argument("--grammar-max-size", type=int, default=g.max_size, metavar="N",
                   help="most symbols a request's schema or grammar may compile to; more is a "
                   "400 (default: %(default)s)")
    p.add_argument("--grammar-compile-s", type=float, default=g.compile_s, metavar="S",
                   help="seconds compiling and checking one schema or grammar may take, off "
                   "the event loop and the engine; more is a 400 (default: %(default)s)")
    p.add_argument("--grammar-mask-ms", type=float, default=g.mask_ms, metavar="MS",
                   help="milliseconds one token mask of a constrained request may take on an "
                   "engine step: a grammar whose first mask costs more than half of it (in "
                   "CPU time, when it is checked) is a 400, and a request whose mask is later than that on a step is ended there "
                   "with an error naming this budget (a 400, or an error event mid-stream), so "
                   "no grammar slows the batch (default: %(default)s)")
    p.add_argument("--sleep-idle-seconds", type=float, metavar="S",
                   help="after S seconds with no request, stop the engine process (the weights "
                   "and KV, prefix cache included, leave memory; /props shows is_sleeping); "
                   "the next request that needs the engine starts it again first "
                   "(default: never)")
    p.add_argument("--embedding", "--embeddings", action="store_true",
                   help="serve /v1/embeddings and /embedding: a prompt's final hidden states "
                   "(after the final norm), pooled by --pooling, through the same prefill "
                   "(completions keep working; default: those routes answer 501)")
    p.add_argument("--pooling", choices=POOLINGS,
                   help="how --embedding pools a prompt's final hidden states, in "
                   "llama-server's names: mean, last (token), cls (the first token), none "
                   "(every token's, on /embedding only) (default: mean)")
    p.add_argument("--n-predict", type=int, metavar="N",
                   help="default n_predict / max_tokens of a request (-1: to the context)")
    p.add_argument("--temp", type=float, metavar="T", help="default temperature of a request")
    p.add_argument("--seed", type=int, metavar="S",
                   help="default seed of a request (-1: a fresh one per request)")


def server_options(args: argparse.Namespace) -> ServerOptions:
    """Parsed `muser serve` flags -> ServerOptions; a bad value raises MuserError."""
    template = args.chat_template
    if args.chat_template_file:
        try:
            template = Path(args.chat_template_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise MuserError(f"cannot read --chat-template-file: {exc.strerror}: "
                             f"{args.chat_template_file}") from None
    if args.temp is not None and args.temp < 0:
        raise MuserError("--temp must be >= 0")
    if args.n_predict is not None and (args.n_predict == 0 or args.n_predict < -1):
        raise MuserError("--n-predict must be -1 or >= 1")
    if args.sleep_idle_seconds is not None and args.sleep_idle_seconds <= 0:
        raise MuserError("--sleep-idle-seconds must be > 0")
    if args.pooling is not None and not args.embedding:
        raise MuserError("--pooling is how --embedding pools: give --embedding with it")
    if args.max_n < 1:
        raise MuserError("--max-n must be >= 1")
    if args.grammar_max_size < 1 or args.grammar_compile_s <= 0 or args.grammar_mask_ms <= 0:
        raise MuserError("--grammar-max-size, --grammar-compile-s and --grammar-mask-ms must "
                         "be > 0")
    limits = GrammarLimits(max_size=args.grammar_max_size, compile_s=args.grammar_compile_s,
                           mask_ms=args.grammar_mask_ms)
    folder = None
    if args.slot_save_path:
        try:
            Path(args.slot_save_path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MuserError(f"cannot create --slot-save-path: {exc.strerror}: "
                             f"{args.slot_save_path}") from None
        folder = os.path.realpath(args.slot_save_path)
    return ServerOptions(
        max_n=args.max_n, keyless_admin=args.keyless_admin, grammar_limits=limits,
        tags=tuple(t.strip() for t in (args.tags or "").split(",") if t.strip()),
        sleep_idle_s=args.sleep_idle_seconds,
        pooling=(args.pooling or "mean") if args.embedding else None,
        strict_model_name=args.strict_model_name,
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        metrics=args.metrics, slots=args.slots, chat_template=template, slot_save_path=folder,
        verbose=args.verbose, thinking=args.reasoning != "off",
        tool_call_parser=args.tool_call_parser,
        defaults=Defaults(args.n_predict, args.temp,
                          None if args.seed is None or args.seed < 0 else args.seed))
