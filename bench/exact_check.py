"""The GPU exactness receipt (bench/results/exact_h200.json): a sequence's logits through the
runner (dummy weights at a preset's shapes), compared bitwise across what may not change them,
and the exact route's cost against the same code with the `exact` switch off, in one process.

Checks, each a cell {model, weights, check, rows, bitwise_rows, max_abs} (rows: logit rows
compared; bitwise_rows: those torch.equal to the reference row):
- chunks_N: a prompt wrapping the sliding ring three times, prefilled in chunks of N rows (1:
  token by token, through the decode width) against one chunk;
- batch_B: a sequence's decode rows (teacher-forced) beside B - 1 others against alone;
- mixed: its decode rows in steps that also prefill another sequence's chunk;
- eager: its decode rows without CUDA graphs against graph replay;
- prefix_same / prefix_mid: after a prefix-cache hit (the same prompt again, resumed before its
  last token; a prompt sharing 1,000 tokens, resumed where the cache ends) against cold;
- sampled_16 (--sampled): seeded sampled tokens (temperature 1) of a request beside 15 others
  against alone (rows: tokens compared).
Costs, each a cell {model, weights, metric, before, after, ratio} (before: `exact` off):
decode step ms at batch 1 and 32, prefill ms of 2,048 tokens.

    PYTHONPATH=. python3 bench/exact_check.py --out $OUT/exact_h200.json
    PYTHONPATH=. python3 bench/exact_check.py --models gemma3-27b --layers 12 --weights fp8 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from muser.config import EngineConfig
from muser.graph.weights import random_weights
from muser.ops.triton.switches import switched
from muser.presets import preset
from muser.startup.start import start as start_runner

DEV = "cuda" if torch.cuda.is_available() else "cpu"
WEIGHTS = {"label": "bf16"}  # the cells' weights field (--weights)


def runner_for(cfg, weights, max_len: int, seqs: int, eager: bool = False,
               prefix: bool = False):
    engine = EngineConfig.for_device(device=DEV, max_num_seqs=seqs, max_model_len=max_len,
                                     prefill_chunk=2048, enforce_eager=eager, prefix_cache=prefix,
                                     quantization="fp8" if WEIGHTS["label"] == "fp8" else "none")
    return start_runner(cfg, engine, weights)


def cell(model, check, got: torch.Tensor, want: torch.Tensor) -> dict:
    same = (got == want).all(1)
    out = {"model": model, "weights": WEIGHTS["label"], "check": check, "rows": int(got.shape[0]),
           "bitwise_rows": int(same.sum()), "max_abs": float((got - want).abs().max())}
    print(out, flush=True)
    return out


def prefill_rows(runner, ids: list[int], chunk: int) -> torch.Tensor:
    seq = runner.allocate()
    rows = []
    for start in range(0, len(ids), chunk):
        rows.append(runner.forward([seq], [ids[start:start + chunk]], all_logits=True).float())
    runner.free(seq)
    return torch.cat(rows)


def decode_rows(runner, prompt: list[int], steps: list[int], others: int = 0,
                mixed: list[int] | None = None) -> torch.Tensor:
    """Prefill `prompt`, then feed `steps` one a step (beside `others` sequences decoding
    their own tokens, or with `mixed`: a chunk of another sequence's prompt each step) -> the
    rows of the first sequence."""
    g = torch.Generator().manual_seed(7)
    seq = runner.allocate()
    runner.forward([seq], [prompt])
    side = [runner.allocate() for _ in range(others)]
    for s in side:
        runner.forward([s], [torch.randint(0, 1000, (int(torch.randint(5, 300, (1,),
                                                                         generator=g)),),
                                           generator=g).tolist()])
    extra = runner.allocate() if mixed else None
    out = []
    for i, t in enumerate(steps):
        if mixed:
            chunk = mixed[i * 40:(i + 1) * 40] or [1]
            out.append(runner.forward([seq, extra], [[t], chunk])[0].float())
        else:
            tokens = [[t]] + [[int(x)] for x in torch.randint(0, 1000, (others,), generator=g)]
            out.append(runner.forward([seq, *side], tokens)[0].float())
    for s in [seq, *side] + ([extra] if extra else []):
        runner.free(s)
    return torch.stack(out)


def prefix_checks(model: str, runner, prompts: dict[str, list[int]],
                  cold: dict[str, torch.Tensor]) -> list[dict]:
    """Logits after a prefix-cache hit (runner's cache filled by the first prompt, computed
    cold there) against the rows another runner computed cold."""
    first = next(iter(prompts.values()))
    seq = runner.allocate()
    runner.forward([seq], [first])
    runner.free(seq)  # cached
    out = []
    for name, prompt in prompts.items():
        seq = runner.allocate(prompt)
        hit = seq.num_cached
        rows = runner.forward([seq], [prompt[hit:]], all_logits=True).float()
        runner.free(seq)
        out.append(cell(model, name, rows, cold[name][hit:]))
        out[-1]["cached_tokens"] = hit
    return out


def sampled_check(model: str, llm, ids: list[int]) -> dict:
    """Seeded sampled tokens of one request alone and beside 15 others."""
    from muser import SamplingParams

    engine = llm.engine

    def run(prompts):
        uids = [engine.add_request(p, SamplingParams(max_tokens=32, temperature=1.0, seed=11 + i,
                                                     ignore_eos=True)).uid
                for i, p in enumerate(prompts)]
        tokens = {u: [] for u in uids}
        while engine.has_work:
            for o in engine.step():
                tokens[o.uid].append(o.token_id)
        return [tokens[u] for u in uids]

    prompts = [ids[i * 50:i * 50 + 100 + 20 * i] for i in range(16)]
    alone = run(prompts[:1])[0]
    together = run(prompts)[0]
    same = sum(a == b for a, b in zip(alone, together))
    out = {"model": model, "weights": WEIGHTS["label"], "check": "sampled_16", "rows": len(alone),
           "bitwise_rows": same, "max_abs": float(sum(a != b for a, b in zip(alone, together)))}
    print(out, flush=True)
    return out


def timed_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def costs(model: str, cfg, weights, prompt: list[int]) -> list[dict]:
    """Each metric on a runner started (warm-up, tuning and CUDA graphs) with the `exact`
    switch off (before) and on (after), one after the other in this process."""
    def decode_step(runner, batch: int):
        seqs = [runner.allocate() for _ in range(batch)]
        for s in seqs:
            runner.forward([s], [prompt[:512]])
        ms = timed_ms(lambda: runner.forward(seqs, [[5]] * batch), 20)
        for s in seqs:
            runner.free(s)
        return ms

    def prefill(runner):
        def run():
            s = runner.allocate()
            runner.forward([s], [prompt[:2048]])
            runner.free(s)
        return timed_ms(run, 5)

    metrics = {"decode_step_ms_b1": lambda r: decode_step(r, 1),
               "decode_step_ms_b32": lambda r: decode_step(r, 32),
               "prefill_2048_ms": prefill}
    measured = {}
    for exact in (False, True):
        with switched(exact=exact):
            runner = runner_for(cfg, weights, 4096, 32)
            measured[exact] = {name: fn(runner) for name, fn in metrics.items()}
            del runner
            torch.cuda.empty_cache()
    out = []
    for name in metrics:
        before, after = measured[False][name], measured[True][name]
        out.append({"model": model, "weights": WEIGHTS["label"], "metric": name,
                    "before": round(before, 4), "after": round(after, 4),
                    "ratio": round(after / before, 4)})
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="gemma3-1b")
    ap.add_argument("--layers", type=int, default=0, help="keep only this many layers (0: all)")
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="bf16",
                    help="fp8: the projections quantized to FP8 (random_weights(fp8=True))")
    ap.add_argument("--costs-only", action="store_true", help="skip the checks")
    ap.add_argument("--sampled", action="store_true",
                    help="also the seeded-sampling check (needs the embedded model's tokenizer)")
    args = ap.parse_args()
    WEIGHTS["label"] = args.weights
    if args.weights == "fp8":  # NOTE: their exact route is behind its switch until checked here
        switched(exact_fp8=True).__enter__()
    result = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "checks": [],
              "costs": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for model in args.models.split(","):
        cfg = preset(model)
        if args.layers:
            cfg = dataclasses.replace(cfg, num_layers=args.layers,
                                      layer_kinds=cfg.layer_kinds[:args.layers])
        weights = random_weights(cfg, torch.bfloat16, DEV, seed=0, fp8=args.weights == "fp8")
        g = torch.Generator().manual_seed(0)
        length = 3 * cfg.sliding_window + 77
        ids = torch.randint(3, 1000, (length,), generator=g).tolist()
        if args.costs_only:
            result["costs"] += costs(model, cfg, weights, ids + ids)
            save()
            continue
        runner = runner_for(cfg, weights, 4096, 64)
        whole = prefill_rows(runner, ids, length)
        for chunk in (512, 256, 64, 37, 1):
            result["checks"].append(cell(model, f"chunks_{chunk}",
                                         prefill_rows(runner, ids, chunk), whole))
            save()
        prompt, steps = ids[:300], ids[300:332]
        alone = decode_rows(runner, prompt, steps)
        result["checks"].append(cell(model, "decode_vs_prefill_rows", alone,
                                     prefill_rows(runner, ids[:332], 332)[300:332]))
        for batch in (2, 8, 33, 64):
            result["checks"].append(cell(model, f"batch_{batch}",
                                         decode_rows(runner, prompt, steps, batch - 1), alone))
            save()
        result["checks"].append(cell(model, "mixed", decode_rows(runner, prompt, steps,
                                                                 mixed=ids[400:]), alone))
        cold = {"prefix_same": whole, "prefix_mid": prefill_rows(
            runner, ids[:1000] + [t + 7 for t in ids[1000:1300]], 1300)}
        del runner
        torch.cuda.empty_cache()
        eager = runner_for(cfg, weights, 4096, 8, eager=True)
        result["checks"].append(cell(model, "eager", decode_rows(eager, prompt, steps), alone))
        save()
        del eager
        torch.cuda.empty_cache()
        cached = runner_for(cfg, weights, 4096, 8, prefix=True)
        prompts = {"prefix_same": ids,
                   "prefix_mid": ids[:1000] + [t + 7 for t in ids[1000:1300]]}
        result["checks"] += prefix_checks(model, cached, prompts, cold)
        save()
        del cached
        torch.cuda.empty_cache()
        if args.sampled:  # NOTE: the engine's tokenizer is the embedded model's
            from muser import LLM

            llm = LLM(load_format="dummy", model_config=model, progress=False, device=DEV,
                      max_num_seqs=32, max_model_len=4096,
                      quantization="fp8" if args.weights == "fp8" else "none")
            result["checks"].append(sampled_check(model, llm, ids))
            save()
            del llm
            torch.cuda.empty_cache()
        result["costs"] += costs(model, cfg, weights, ids + ids)
        save()
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
