"""`muser` command line: generate | bench | serve."""

from __future__ import annotations

import argparse
import json
import sys

from muser.bench import add_bench_parser
from muser.core import SamplingParams
from muser.disagg.cli import add_worker_parser
from muser.engine_args import (
    add_engine_args,
    engine_kwargs,
    model_kwargs,
    non_negative,
    positive_int,
    unit_interval,
)
from muser.errors import MuserError
from muser.llm import LLM
from muser.tune_cli import add_tune_parser


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
    gen.set_defaults(run=_generate)
    add_bench_parser(sub)
    add_tune_parser(sub)
    add_worker_parser(sub)
    try:  # NOTE: the server's dependencies are an optional extra
        from muser.server.cli import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    return parser


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file:
        raise MuserError("give the prompt as PROMPT or --prompt-file, not both")
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise MuserError(f"cannot read --prompt-file: {exc.strerror}: {args.prompt_file}")
    if args.prompt is not None:
        return args.prompt
    if sys.stdin.isatty():
        raise MuserError("no prompt: pass PROMPT, --prompt-file F, or pipe text on stdin")
    return sys.stdin.read()


def _generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    if not prompt:
        raise MuserError("the prompt is empty")
    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
            seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    except ValueError as exc:
        raise MuserError(str(exc)) from None
    llm = LLM(args.model, progress=not args.json, max_num_seqs=1, **model_kwargs(args),
              **engine_kwargs(args))
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = llm.encode(prompt)
    if args.json:
        c = llm.generate(ids, sampling)
        print(json.dumps({
            "prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids, "text": c.text,
            "finish_reason": c.finish_reason, "ttft_s": c.ttft_s, "tpot_s": c.tpot_s,
            "prefill_tokens_per_s": c.prefill_tokens_per_s,
            "decode_tokens_per_s": c.decode_tokens_per_s,
        }, ensure_ascii=False))
        return 0
    for out in llm.stream(ids, sampling):
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except MuserError as exc:
        print(f"muser: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
