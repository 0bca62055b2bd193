"""`muser generate`: one prompt through the engine, streamed to stdout (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys

from muser.core import SamplingParams
from muser.engine_args import engine_kwargs, model_kwargs
from muser.errors import MuserError
from muser.llm import LLM


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


def run(args: argparse.Namespace) -> int:
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
            "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
        }, ensure_ascii=False))
        return 0
    for out in llm.stream(ids, sampling):
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
