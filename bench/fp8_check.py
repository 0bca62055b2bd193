"""FP8 weights on one H200 (`--quantization fp8`), as JSON; not run on the CPU.

- copy: torch copy of a 1 GiB buffer (bytes read + written per second), the yardstick;
- gemv: gemma3-27b's projections (hidden 5376, intermediate 21504, 32 x 128 heads, 16 x 128
  KV) at 1 and 8 rows: every FP8 GEMV candidate timed by `linear_fp8.tune` (CUDA graphs,
  weights rotated past L2), the fastest one's weight bytes read per second and its fraction
  of copy bandwidth (the issue asks >= 0.85), and its error against float64 on the exact
  dequantized weights;
- quantize: the prefill route's activation quantization at the four K, 512 and 2,048 rows,
  per launch rule (the current one and neighbours; with --base DIR, that checkout's beside
  it), us and bandwidth;
- prefill: the same matrices at 2048 rows: `torch._scaled_mm` alone (x already FP8), the
  scaled_mm route (x quantized per token first), the dequant route and bfloat16 `torch.mm`,
  in TFLOP/s, and the route `linear_fp8.tune` picks;
- load_27b: `--load-format dummy --model-config gemma3-27b --quantization fp8`'s weights
  made on the GPU matrix by matrix: bytes held and peak memory;
- accuracy: gemma3-1b random bfloat16 weights served with and without --quantization fp8
  (the same draws; LLM's warm-up included): top-1 agreement and KL(bf16 || fp8) of the
  next-token distributions at the DESIGN boundary positions (1, 31, 32, 33, W-1, W, W+1,
  2W-1, 2W, 2W+1; W = 512), prefilled in one chunk (the prefill route) and token by token
  (the decode GEMV); for FP8 as it runs, with a bfloat16 head, and with scaled_mm's float32
  accumulation.

    python3 bench/fp8_check.py --out $OUT/fp8_check.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muser.ops.fp8 import quantize_activations, quantize_fp8

BF16 = torch.bfloat16
HIDDEN, INTER, Q, KV = 5376, 21504, 32 * 128, 16 * 128
SHAPES_27B = {"qkv": (Q + 2 * KV, HIDDEN), "o_proj": (HIDDEN, Q),
              "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
LOG: list[str] = []


def say(line: str) -> None:
    LOG.append(line)
    print(line, file=sys.stderr, flush=True)


def _ms(fn, reps: int = 20) -> float:
    """ms per call of fn(), the best of 3 runs of `reps` calls timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def copy_bandwidth() -> dict:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _ms(lambda: dst.copy_(src), reps=10)
    out = {"bytes": 2 << 30, "ms": ms, "GBps": 2 * (1 << 30) / ms / 1e6}
    say(f"copy 1 GiB: {ms:.3f} ms, {out['GBps']:.0f} GB/s (read + write)")
    return out


def _weight(m: int, k: int, gen: torch.Generator):
    w = torch.randn(m, k, generator=gen, device="cuda") * k**-0.5
    return quantize_fp8(w.to(BF16))


def gemv(copy_gbps: float, gen: torch.Generator) -> dict:
    out = {}
    for name, (m, k) in SHAPES_27B.items():
        for n in (1, 8):
            row = out[f"{name} n={n}"] = _gemv_shape(m, k, n, copy_gbps, gen)
            say(f"gemv {name} [{m} x {k}] n={n}: {row['ms'] * 1e3:.1f} us, {row['GBps']:.0f} "
                f"GB/s = {row['of_copy']:.2f} of copy, err/sum|xw| "
                f"{row['err_over_sum_abs']:.1e} ({row['pick']})")
            torch.cuda.empty_cache()
    return out


def _gemv_shape(m: int, k: int, n: int, copy_gbps: float, gen: torch.Generator) -> dict:
    from muser.ops.triton import linear_fp8
    from muser.ops.triton.linear import _key

    w = _weight(m, k, gen)
    exact = w.dequantize(torch.float64)
    x = torch.randn(n, k, generator=gen, device="cuda").to(BF16)
    key = _key(x, w, "")
    pick = linear_fp8.tune(key, x, w, False, None)
    best = min(linear_fp8.PICKS.timed[key].values())
    y = linear_fp8.project(x, w, False, None).double()
    ref = x.double() @ exact.t()
    magnitude = (x.double().abs() @ exact.abs().t()).max().item()
    err = (y - ref).abs().max().item()
    gbps = w.nbytes() / best / 1e6
    return {"pick": str(pick), "ms": best, "GBps": gbps, "of_copy": gbps / copy_gbps,
            "max_abs_err": err, "err_over_sum_abs": err / magnitude,
            "within_bf16_rounding": err <= 2.0**-8 * ref.abs().max().item() + 1e-5 * magnitude,
            "timed_ms": linear_fp8.PICKS.timed[key]}


def prefill(gen: torch.Generator, rows: int = 2048) -> dict:
    out = {}
    for name, (m, k) in SHAPES_27B.items():
        out[name] = _prefill_shape(m, k, rows, gen)
        say(f"prefill {name} [{m} x {k}] x {rows} rows: " + ", ".join(
            f"{label} {v['TFLOPs']:.0f}" for label, v in out[name].items()
            if isinstance(v, dict)) + f" TFLOP/s; picks {out[name]['pick']}")
        torch.cuda.empty_cache()
    return out


def _prefill_shape(m: int, k: int, rows: int, gen: torch.Generator) -> dict:
    from muser.ops.triton import linear_fp8
    from muser.ops.triton.linear import _key

    w = _weight(m, k, gen)
    w_bf16 = w.dequantize(BF16)
    x = torch.randn(rows, k, generator=gen, device="cuda").to(BF16)
    xq = quantize_activations(x)
    flops = 2 * rows * m * k
    timings = {
        "scaled_mm_only": lambda: torch._scaled_mm(
            xq.data, w.data.t(), scale_a=xq.scales[:, None], scale_b=w.scales[None, :],
            out_dtype=BF16),
        "scaled_mm_route": lambda: linear_fp8.scaled_mm(x, w),
        "dequant_route": lambda: linear_fp8.dequant_mm(x, w),
        "bf16_mm": lambda: torch.mm(x, w_bf16.t()),
    }
    row: dict = {}
    for label, fn in timings.items():
        ms = _ms(fn, reps=10)
        row[label] = {"ms": ms, "TFLOPs": flops / ms / 1e9}
    row["pick"] = linear_fp8.tune(_key(x, w, ""), x, w, False, None)
    exact = x.double() @ w.dequantize(torch.float64).t()
    got = linear_fp8.scaled_mm(x, w).double()
    row["scaled_mm_rel_l2_vs_float64"] = ((got - exact).norm() / exact.norm()).item()
    return row


def load_27b() -> dict:
    from muser.graph.weights import random_weights
    from muser.presets import preset

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    weights = random_weights(preset("gemma3-27b"), BF16, "cuda", fp8=True)
    torch.cuda.synchronize()
    out = {"s": time.perf_counter() - t0, "weights_bytes": weights.nbytes(),
           "peak_bytes": torch.cuda.max_memory_allocated() - before}
    say(f"gemma3-27b dummy fp8: {out['weights_bytes'] / 2**30:.1f} GiB held, peak "
        f"{out['peak_bytes'] / 2**30:.1f} GiB, {out['s']:.1f} s")
    del weights
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _logits(quantization: str, ids: list[int], positions: list[int], model: str = "gemma3-1b",
            device: str = "cuda", **engine) -> dict[str, torch.Tensor]:
    """Float64 CPU logits at `positions` of dummy `model` served with `quantization` (and
    `engine`'s other EngineConfig fields): the prompt in one chunk, and token by token."""
    from muser.llm import LLM

    llm = LLM(None, progress=False, load_format="dummy", model_config=model, device=device,
              quantization=quantization, max_num_seqs=1, max_model_len=4096,
              gpu_memory_utilization=0.3, **engine)
    runner = llm.runner
    out = {}
    for label, chunk in (("one_chunk", len(ids)), ("token_by_token", 1)):
        seq, rows = runner.allocate(), {}
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            logits = runner.forward([seq], [part], all_logits=True)
            rows |= {p: logits[p - start] for p in positions if start <= p < start + len(part)}
        runner.free(seq)
        out[label] = torch.stack([rows[p] for p in positions]).double().cpu()
    del llm, runner
    gc.unfreeze()  # LLM freezes what startup made
    gc.collect()
    torch.cuda.empty_cache()
    return out


def accuracy(gen: torch.Generator) -> dict:
    """bfloat16 against --quantization fp8 as it runs (FP8 head, scaled_mm's fast
    accumulation), with a bfloat16 head (--no-fp8-head), and with scaled_mm accumulating in
    float32 (linear_fp8.FAST_ACCUM off): each one's top-1 agreement and KL(bf16 || it)."""
    from muser.ops.triton import linear_fp8

    window = 512  # gemma3-1b
    positions = [1, 31, 32, 33, window - 1, window, window + 1, 2 * window - 1, 2 * window,
                 2 * window + 1]
    ids = torch.randint(0, 262_144, (2 * window + 2,), generator=gen, device="cuda").tolist()
    bf16 = _logits("none", ids, positions)
    variants = {"fp8": {}, "fp8_bf16_head": {"fp8_head": False}, "fp8_float32_accum": {}}
    out: dict = {"model": "gemma3-1b dummy (seed 0)", "positions": positions}
    for name, engine in variants.items():
        linear_fp8.FAST_ACCUM = name != "fp8_float32_accum"  # read by every scaled_mm call
        fp8 = _logits("fp8", ids, positions, **engine)
        cell = out[name] = {}
        for label in bf16:
            p_log, q_log = bf16[label].log_softmax(-1), fp8[label].log_softmax(-1)
            kl = (p_log.exp() * (p_log - q_log)).sum(-1)
            top1 = bf16[label].argmax(-1) == fp8[label].argmax(-1)
            cell[label] = {"top1_agreement": top1.double().mean().item(),
                           "top1_per_position": top1.tolist(), "kl_per_position": kl.tolist(),
                           "kl_mean": kl.mean().item(), "kl_max": kl.max().item()}
            say(f"accuracy {name} {label}: top-1 agreement {cell[label]['top1_agreement']:.2f}, "
                f"KL mean {cell[label]['kl_mean']:.2e} max {cell[label]['kl_max']:.2e}")
    linear_fp8.FAST_ACCUM = True
    return out


def _module_at(tree: str, name: str):
    """muser/ops/triton/<name>.py of another checkout of the package (imports resolve to this
    one), for a side-by-side timing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"base_{name}",
                                                  Path(tree) / "muser/ops/triton" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantize(copy_gbps: float, gen: torch.Generator, base: str | None) -> dict:
    """The scaled_mm route's activation quantization (quantize_rows_fp8) at the 27B's four K
    and 512 / 2,048 rows, per launch rule, and the second kernel alone (the block maxima given,
    as GeGLU gives them); with `base` (another checkout) its quantize_rows_fp8 too ("before"):
    us a call and bytes moved (read + write) per second against copy."""
    from muser.ops.triton.launch import cdiv
    from muser.ops.triton.quantize_fp8 import launch_rule, quantize_rows_fp8

    runs = {name: (lambda x, r=rule: quantize_rows_fp8(x, r)) for name, rule in (
        ("rule", launch_rule), ("512x4", lambda k: (512, 4)), ("2048x4", lambda k: (2048, 4)),
        ("2048x8", lambda k: (2048, 8)))}
    if base:
        runs["before"] = _module_at(base, "quantize_fp8").quantize_rows_fp8
    out = {}
    for k in sorted({k for _, k in SHAPES_27B.values()}):
        for rows in (512, 2048):
            x = torch.randn(rows, k, generator=gen, device="cuda").to(BF16)
            want = quantize_activations(x)
            block = launch_rule(k)[0]
            padded = torch.nn.functional.pad(x.float().abs(), (0, cdiv(k, block) * block - k))
            maxima = padded.view(rows, -1, block).amax(2).contiguous()
            cell = {}
            for name, run in {**runs, "given maxima":
                              lambda x, m=maxima: quantize_rows_fp8(x, block_amax=m)}.items():
                got = run(x)
                assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
                assert torch.equal(got.scales, want.scales)
                ms = _ms(lambda r=run, x=x: r(x), reps=50)
                gbps = rows * k * 3 / ms / 1e6
                cell[name] = {"us": ms * 1e3, "GBps": gbps, "of_copy": gbps / copy_gbps}
            out[f"K={k} rows={rows}"] = cell
            say(f"quantize K={k} rows={rows}: " + ", ".join(
                f"{n} {c['us']:.1f} us ({c['of_copy']:.2f})" for n, c in cell.items()))
    return out


SECTIONS = ("copy", "gemv", "quantize", "prefill", "load_27b", "accuracy")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/fp8_check.json")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--base", help="another checkout whose activation quantization is timed "
                                   "beside this one's (quantize)")
    args = ap.parse_args()
    sections = args.sections.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "wall_s": {}}
    copy_gbps = 0.0
    for name in SECTIONS:
        if name not in sections:
            continue
        t0 = time.perf_counter()
        if name == "copy":
            result["copy"] = copy_bandwidth()
            copy_gbps = result["copy"]["GBps"]
        elif name == "gemv":
            result["gemv"] = gemv(copy_gbps or copy_bandwidth()["GBps"], gen)
        elif name == "quantize":
            result["quantize"] = quantize(copy_gbps or copy_bandwidth()["GBps"], gen, args.base)
        elif name == "prefill":
            result["prefill"] = prefill(gen)
        elif name == "load_27b":
            result["load_27b"] = load_27b()
        else:
            result["accuracy"] = accuracy(gen)
        result["wall_s"][name] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result | {"log": LOG}, indent=1, default=str))
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
