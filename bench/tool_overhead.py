"""Per-token cost of each tool mode (the embedded 270M model, CPU), side by side in one run.

The same prompt decoded --tokens tokens, greedy, in turn (--repeats rounds): with no grammar;
with the JSON tool format's auto-mode grammar (the reply is text: the grammar's free branch);
with its required-mode grammar (a call whose one string argument is at least 400 characters,
so the grammar cannot end within --tokens tokens). Reports decode ms per token of each run,
the medians and their ratios to the unconstrained median.

    python bench/tool_overhead.py --threads 1 --out bench/results/tool_overhead_cpu.json
"""

from __future__ import annotations

import json
import platform
import statistics

import torch
from grammar_overhead import setup, tpot
from llguidance import LLMatcher

from muser.server.tool_format import Function
from muser.server.tool_json import JsonFormat

NOTE = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}},
        "required": ["text"], "additionalProperties": False}
FUNCTIONS = [Function("write_note", None, NOTE),
             Function("get_weather", None, {"type": "object", "properties": {
                 "city": {"type": "string"}}, "required": ["city"]})]


def main() -> None:
    args, llm = setup(__doc__)
    fmt = JsonFormat()
    modes = {"none": None,
             "auto": LLMatcher.grammar_from_lark(fmt.grammar(FUNCTIONS, False, True)),
             "required": LLMatcher.grammar_from_lark(fmt.grammar(FUNCTIONS, True, False))}
    for grammar in modes.values():
        tpot(llm, 4, grammar)  # NOTE: warm-up (the vocabulary table on the first grammar)
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, grammar in modes.items():
            runs[mode].append(tpot(llm, args.tokens, grammar))
    medians = {m: statistics.median(v) for m, v in runs.items()}
    result = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads (shared)",
              "tokens": args.tokens, "repeats": args.repeats,
              "decode_ms_per_token": {m: [round(x, 1) for x in v] for m, v in runs.items()},
              "median_ms": {m: round(x, 1) for m, x in medians.items()},
              "ratio_to_none": {m: round(x / medians["none"], 2) for m, x in medians.items()}}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
