"""What clients ask beyond plain sampling, on the GPU: logprobs, n samples forked from one
prefill, penalties and JSON-schema grammars, checked and timed in one engine.

    python3 bench/gpu_sampling.py --model-config gemma3-1b --out $OUT/sampling_h200.json

Dummy weights of the preset (its real vocabulary from the tokenizer stand-in). Checks: greedy
tokens are the same with and without logprobs, and a greedy token's logprob is its row's best;
the n samples of a seeded request against separate requests of seed + i (forked KV against a
prefill of their own: the fraction of tokens that match); every JSON-schema output that ended
parses and holds the schema's required keys. Timing: --rows requests decoding together, the
median engine step with every row plain, every row asking for 5 logprobs, with presence and
frequency penalties, and under a grammar (one that never ends: every run decodes every row);
each against plain in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from muser import LLM, SamplingParams
from muser.server.structured import compile_grammar

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"], "additionalProperties": False}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_all(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Requests decoding together -> their outputs by uid and the step times once all decode."""
    engine = llm.engine
    reqs = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    outs: dict[int, list] = {r.uid: [] for r in reqs}
    steps = []
    while engine.has_work:
        t0 = time.perf_counter()
        got = engine.step()
        steps.append(time.perf_counter() - t0)
        for out in got:
            outs.setdefault(out.uid, []).append(out)
    return {"outs": outs, "uids": [r.uid for r in reqs], "steps_s": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="gemma3-1b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cpu: the embedded model (a dry run)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = {"load_format": "dummy", "model_config": args.model_config} if (
        args.device != "cpu") else {}
    llm = LLM(None, device=args.device, max_num_seqs=max(8, args.rows), max_model_len=2048,
              progress=False, **model)
    vocab = llm.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab - 10, (96,), generator=gen).tolist()
               for _ in range(args.rows)]
    receipt: dict = {"gpu": torch.cuda.get_device_name() if args.device != "cpu" else None,
                     "torch": torch.__version__,
                     "model": f"{args.model_config} (dummy weights)", "rows": args.rows}

    # logprobs change no token; a greedy token's logprob is its row's best
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=5)
    a = run_all(llm, prompts, [plain] * args.rows)
    b = run_all(llm, prompts, [with_lp] * args.rows)
    same = all([o.token_id for o in a["outs"][ua]] == [o.token_id for o in b["outs"][ub]]
               for ua, ub in zip(a["uids"], b["uids"]))
    best = all(o.logprobs.top and o.logprobs.top[0][0] == o.token_id
               and abs(o.logprobs.top[0][1] - o.logprobs.logprob) < 1e-6
               and all(x[1] >= y[1] for x, y in zip(o.logprobs.top, o.logprobs.top[1:]))
               for u in b["uids"] for o in b["outs"][u] if o.token_id is not None)
    receipt["logprobs"] = {"greedy_tokens_unchanged": same, "greedy_logprob_is_the_best": best}
    say(f"logprobs: tokens unchanged {same}, greedy = best {best}")

    # n samples forked from one prefill against separate requests with seed + i
    hot = {"max_tokens": 32, "ignore_eos": True, "temperature": 1.0, "seed": 11}
    forked = run_all(llm, prompts[:1], [SamplingParams(**hot, n=4)])
    by_index: dict[int, list[int]] = {}
    for o in forked["outs"][forked["uids"][0]]:
        if o.token_id is not None:
            by_index.setdefault(o.index, []).append(o.token_id)
    alone = run_all(llm, prompts[:1] * 4, [SamplingParams(**hot | {"seed": 11 + i})
                                           for i in range(4)])
    match = [sum(x == y for x, y in zip(by_index.get(i, []), [o.token_id for o in
                 alone["outs"][u] if o.token_id is not None])) / 32
             for i, u in enumerate(alone["uids"])]
    receipt["samples"] = {"n": 4, "tokens_each": 32, "samples_seen": len(by_index),
                          "match_fraction_vs_own_prefill": match}
    say(f"n=4: samples {len(by_index)}, token match vs own prefill {match}")

    # JSON schema outputs
    grammar = compile_grammar("schema", SCHEMA)
    constrained = SamplingParams(max_tokens=64, temperature=1.0, seed=5, grammar=grammar)
    g = run_all(llm, prompts, [constrained] * args.rows)
    valid, ended = 0, 0
    for u in g["uids"]:
        outs = g["outs"][u]
        text = "".join(o.text_delta for o in outs)
        if outs and outs[-1].finish_reason == "stop":
            ended += 1
            obj = json.loads(text)
            valid += isinstance(obj, dict) and set(obj) == {"name", "age"}
    receipt["grammar"] = {"requests": args.rows, "ended_by_grammar": ended, "valid": valid}
    say(f"grammar: {ended} ended, {valid} valid of {args.rows}")

    # step cost: plain vs each feature, alternated, same prompts; the grammar never ends
    # before --steps tokens (lower-case words), so every run decodes all rows all the way
    words = compile_grammar("gbnf", 'root ::= [a-z ]+')
    base = {"max_tokens": args.steps, "ignore_eos": True, "temperature": 1.0, "seed": 1}
    kinds = {"plain": SamplingParams(**base), "logprobs_5": SamplingParams(**base, logprobs=5),
             "penalties": SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.5),
             "grammar": SamplingParams(**base, grammar=words)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(3):
        for name, params in kinds.items():
            r = run_all(llm, prompts, [params] * args.rows)
            times[name].append(statistics.median(r["steps_s"][4:]) * 1e3)
    plain_ms = statistics.median(times["plain"])
    receipt["step_ms"] = {k: {"median_ms": statistics.median(v), "runs_ms": v,
                              "vs_plain": statistics.median(v) / plain_ms}
                          for k, v in times.items()}
    say(f"step ms: {json.dumps({k: round(v['median_ms'], 3) for k, v in receipt['step_ms'].items()})}")
    args.out.write_text(json.dumps(receipt, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
