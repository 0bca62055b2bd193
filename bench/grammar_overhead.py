"""Per-token cost of constrained decoding in the engine (the embedded 270M model, CPU).

Three figures: (1) the host mask of R constrained rows per step (GrammarMasks.masks, on its
thread pool: muser/grammar.py), (2) the sampler applying it (BatchSampler.constrain on
[R, 262144] logits), each as the median over a JSON-schema walk; (3) decode time per token of
the same prompt with and without a grammar (alternated --repeats times; a grammar that never
ends early, so both runs decode --tokens tokens).

    python bench/grammar_overhead.py --threads 1 --out bench/results/grammar_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

from muser import LLM, SamplingParams
from muser.sampler import BatchSampler
from muser.server.structured import JSON_OPTIONS

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}
TEXT = '{"name":"Ada Lovelace","age":36,"tags":["math","poetry","engines"]}'
LONG = 'root ::= [a-z ]{400}'  # NOTE: cannot end within --tokens tokens


def _host_costs(llm: LLM, num_rows: int) -> dict:
    """Median us per step for the masks of num_rows rows walking TEXT, and for applying them."""
    masks, tok = llm.engine.grammars, llm.tokenizer
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    rows = [masks.compile(grammar) for _ in range(num_rows)]
    sampler = BatchSampler(torch.device("cpu"))
    logits = torch.randn(num_rows, tok.vocab_size)
    mask_us, apply_us = [], []
    for t in tok.encode(TEXT, add_bos=False):
        t0 = time.perf_counter()
        bitmask = masks.masks(rows)
        t1 = time.perf_counter()
        sampler.constrain(logits, bitmask)
        t2 = time.perf_counter()
        mask_us.append((t1 - t0) * 1e6)
        apply_us.append((t2 - t1) * 1e6)
        for c in rows:
            assert c.consume(t)
    return {"rows": num_rows, "steps": len(mask_us),
            "mask_us_p50": round(statistics.median(mask_us[1:]), 1),
            "mask_us_max": round(max(mask_us[1:]), 1),
            "apply_us_p50": round(statistics.median(apply_us[1:]), 1)}


def tpot(llm: LLM, tokens: int, grammar: str | None) -> float:
    """Decode ms per token of the embedded model's greedy reply under `grammar` (or none)."""
    c = llm.generate("Write a sentence:", SamplingParams(
        max_tokens=tokens, temperature=0, ignore_eos=True, grammar=grammar))
    assert len(c.token_ids) == tokens, c.text
    return c.tpot_s * 1e3


def setup(doc: str) -> tuple[argparse.Namespace, LLM]:
    """The decode-cost benches' flags (--tokens, --repeats, --threads, --out) and the embedded
    model on the CPU."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    llm = LLM(None, progress=False, device="cpu")
    if args.threads:
        torch.set_num_threads(args.threads)  # NOTE: after LLM(), which sets its own count
    return args, llm


def main() -> None:
    args, llm = setup(__doc__)
    t0 = time.perf_counter()
    llm.engine.grammars.compile(LLMatcher.grammar_from_lark('start: "x"'))
    vocab_s = time.perf_counter() - t0
    host = [_host_costs(llm, r) for r in (1, 4, 16)]
    lark = LLMatcher.grammar_from_lark(gbnf_to_lark(LONG))
    tpot(llm, 4, None), tpot(llm, 4, lark)  # NOTE: warm-up
    free, held = [], []
    for _ in range(args.repeats):
        free.append(tpot(llm, args.tokens, None))
        held.append(tpot(llm, args.tokens, lark))
    result = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads (shared)",
              "vocab": llm.tokenizer.vocab_size, "vocab_table_s": round(vocab_s, 2),
              "host_per_step": host, "decode_ms_per_token_free": [round(x, 1) for x in free],
              "decode_ms_per_token_grammar": [round(x, 1) for x in held]}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
