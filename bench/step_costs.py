"""What one engine step costs on the GPU, by its make-up: the measurements behind the batching
defaults (muser/config.py BATCHING), and the GPU batching check.

    single .... one stream's TPOT through LLM.generate against its decode graph replayed alone
    steps ..... decode-only steps at batch B (graph replay) after 512-token prompts, the same B
                decode rows beside a prefill chunk of c rows (one mixed eager step), and
                prefill-only steps of w rows (several 512-row chunks), each timed host to host
                (metadata, launch, sampling, the copy of the ids)
    batching .. greedy tokens over 64 steps of W1's 32 prompts, each alone and all together
                (mixed steps): how many sequences match, and at the first divergence of each
                that does not, the logit difference there

    python bench/step_costs.py --out bench/results/step_costs_h200.json \
        --shapes gemma3-1b gemma3-27b [--tokenizer-gguf F]

Dummy weights of the presets (no model file travels to the GPU machine); --tokenizer-gguf
stands in for the embedded model package, whose tokenizer they still read
(bench/startup_h200.py, standin_package).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from muser import LLM, SamplingParams
from muser.sampler import BatchSampler, SamplingRow

PROMPT = 512
CAPS = (0, 64, 128, 256, 512)
WIDTHS = (512, 1024, 2048, 4096)


def _timed(fn, reps: int) -> float:
    """Median milliseconds of fn() host to host (the GPU drained after each call)."""
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def step_costs(llm: LLM, batches: list[int]) -> dict:
    runner, sampler = llm.runner, BatchSampler(llm.runner.device)
    greedy = SamplingRow(SamplingParams(), 0, 0, [])
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(n)]

    def step(seqs, rows):
        logits = runner.forward(seqs, rows, logit_rows=_last_rows(rows))
        sampler(logits, [greedy] * len(rows))

    out = {"decode_ms": {}, "mixed_ms": {}, "prefill_tok_s": {}}
    for width in WIDTHS:
        if width > llm.config.max_batched_tokens:
            continue
        chunks = [[7] * PROMPT] * (width // PROMPT)

        def prefill(chunks=chunks):
            seqs = [runner.allocate() for _ in chunks]
            step(seqs, chunks)
            for s in seqs:
                runner.free(s)
        out["prefill_tok_s"][width] = round(width / _timed(prefill, 5) * 1e3)
    for batch in batches:
        seqs = [runner.allocate() for _ in range(batch + 1)]
        try:
            for s in seqs[:batch]:
                runner.forward([s], [prompt(PROMPT)])
            decode = seqs[:batch]
            out["decode_ms"][batch] = round(_timed(lambda d=decode: step(d, [[7]] * len(d)),
                                                   20), 3)
            mixed = {}
            for cap in CAPS[1:]:
                def mixed_step(cap=cap, seqs=seqs, batch=batch):
                    if seqs[batch].num_cached + cap >= llm.config.max_model_len:
                        runner.free(seqs[batch])
                        seqs[batch] = runner.allocate()
                    step(seqs, [[7]] * batch + [[7] * cap])
                mixed[cap] = round(_timed(mixed_step, 8), 3)
            out["mixed_ms"][batch] = mixed
        finally:
            for s in seqs:
                runner.free(s)
        print(f"  batch {batch}: decode {out['decode_ms'][batch]} ms, mixed {mixed}",
              file=sys.stderr)
    return out


def single_stream(llm: LLM) -> dict:
    """One stream's TPOT through the public API (LLM.generate, 512-token prompt, 128 new
    tokens) against the batch-1 decode graph replayed alone, back to back."""
    rng = random.Random(3)
    prompt = [rng.randrange(10, 1000) for _ in range(PROMPT)]
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    llm.generate(prompt, params)
    tpot = statistics.median(llm.generate(prompt, params).tpot_s * 1e3 for _ in range(3))
    graph = llm.runner.graphs.graphs[1]
    replay = _timed(lambda: [graph.replay() for _ in range(50)], 5) / 50
    return {"public_api_tpot_ms": round(tpot, 4), "graph_replay_ms": round(replay, 4),
            "ratio": round(tpot / replay, 3)}


def _last_rows(rows: list[list[int]]) -> list[int]:
    ends, total = [], 0
    for r in rows:
        total += len(r)
        ends.append(total - 1)
    return ends


def batching(llm: LLM, num: int = 32, steps: int = 64) -> dict:
    """Greedy tokens of W1's prompts alone vs together, and logits at the first divergence."""
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 1000) for _ in range(PROMPT)] for _ in range(num)]
    engine = llm.engine
    real = engine.sampler
    records: list = []

    def record(logits, rows):
        records.append(logits.float().clone())
        return real(logits, rows)

    engine.sampler = record

    def run(batch: list[list[int]]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        reqs = [engine.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True))
                for p in batch]
        index = {r.uid: i for i, r in enumerate(reqs)}
        tokens = [[] for _ in batch]
        rows = [[] for _ in batch]
        while engine.has_work:
            records.clear()
            for k, o in enumerate(engine.step()):
                tokens[index[o.uid]].append(o.token_id)
                rows[index[o.uid]].append(records[0][k])
        return tokens, rows

    try:
        together, rows_t = run(prompts)
        alone = [run([p]) for p in prompts]
    finally:
        engine.sampler = real
    result = {"sequences": num, "steps": steps, "match": 0, "divergences": []}
    for i, (toks, rows) in enumerate(alone):
        a, b = toks[0], together[i]
        if a == b:
            result["match"] += 1
            continue
        k = next(j for j in range(steps) if a[j] != b[j])
        ra, rb = rows[0][k], rows_t[i][k]
        top2 = torch.topk(ra, 2).values
        result["divergences"].append({
            "sequence": i, "step": k, "max_abs_logit_diff": float((ra - rb).abs().max()),
            "alone_top2_gap": float(top2[0] - top2[1]),
            "max_abs_logit_diff_before": max(
                (float((rows[0][j] - rows_t[i][j]).abs().max()) for j in range(k)), default=0.0),
        })
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="+", default=["gemma3-1b", "gemma3-27b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--skip-batching", action="store_true")
    ap.add_argument("--tokenizer-gguf", type=Path)
    args = ap.parse_args()
    if args.tokenizer_gguf:
        import tempfile

        from startup_h200 import standin_package

        sys.path.insert(0, str(standin_package(args.tokenizer_gguf, Path(tempfile.mkdtemp()))))
    receipt = json.loads(args.out.read_text()) if args.out.exists() else {}
    receipt["gpu"] = torch.cuda.get_device_name()
    for shape in args.shapes:
        print(f"{shape}: loading", file=sys.stderr)
        t0 = time.perf_counter()
        llm = LLM(load_format="dummy", model_config=shape, device="cuda", progress=False,
                  max_num_seqs=max(args.batches) + 1, max_model_len=4096,
                  max_batched_tokens=max(WIDTHS))
        cell = {"startup_s": round(time.perf_counter() - t0, 1),
                "config": {k: getattr(llm.config, k) for k in (
                    "max_num_seqs", "max_batched_tokens", "decode_waiting_chunk",
                    "prefill_chunk")}}
        cell["single_stream"] = single_stream(llm)
        print(f"  single stream: {cell['single_stream']}", file=sys.stderr)
        cell["steps"] = step_costs(llm, args.batches)
        if not args.skip_batching:
            cell["batching"] = batching(llm)
            print(f"  batching: {cell['batching']['match']}/32 match", file=sys.stderr)
        receipt[shape] = cell
        args.out.write_text(json.dumps(receipt, indent=1))
        del llm
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
