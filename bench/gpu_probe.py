"""Where the time goes on the GPU, in one device call (exploration; gpu_bench.py is the receipt).

- gemma3-1b prefill: wall time, the time until forward() returns (host work), and the ops that
  take host time (torch.profiler, CPU and CUDA);
- decode: the measured time of every GEMV candidate per projection shape, and the kernels of
  one graph replay;
- transformers with a static cache + torch.compile (bench/hf_compiled.py), written to
  hf_compiled.json for gpu_bench.py to reuse;
- with --step: only gemma3-1b's decode step split into its host and device parts, and a wider
  sweep of GEMV configs on the down projection (gpu_probe_step.json).

    PYTHONPATH=. python3 bench/gpu_probe.py --out $OUT
    PYTHONPATH=. python3 bench/gpu_probe.py --step --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import BF16, DEV, LOG, _profile, environment, make_runner, say
from hf_compiled import compiled_prefill, static_compile_decode
from hf_twin import hf_twin

from muser.graph.weights import random_weights
from muser.presets import preset


def host_profile(runner, ids: list[int]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    times, host = [], []
    for _ in range(5):
        seq = runner.allocate()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.forward([seq], [ids])
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        runner.free(seq)
    out = {"wall_ms": statistics.median(times[1:]) * 1e3,
           "until_return_ms": statistics.median(host[1:]) * 1e3}
    say(f"  prefill {len(ids)}: wall {out['wall_ms']:.1f} ms, forward() returns after "
        f"{out['until_return_ms']:.1f} ms")
    seq = runner.allocate()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.forward([seq], [ids])
        torch.cuda.synchronize()
    runner.free(seq)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:30]
    out["host_ops"] = {e.key[:70]: [round(e.self_cpu_time_total / 1e3, 3), e.count]
                       for e in rows}
    gpu = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))
    out["gpu_ops"] = {e.key[:70]: [round(getattr(e, "self_device_time_total", 0) / 1e3, 3),
                                   e.count] for e in gpu[:20]}
    say("  host ms (self, count):")
    for k, v in out["host_ops"].items():
        say(f"    {v[0]:8.3f} x{v[1]:<5} {k}")
    say("  gpu ms (self, count):")
    for k, v in out["gpu_ops"].items():
        say(f"    {v[0]:8.3f} x{v[1]:<5} {k}")
    return out


def step_breakdown(runner, ids: list[int], steps: int = 60) -> dict:
    """One decode step of runner.forward, piece by piece (host microseconds until each piece
    returns; `sample` includes the wait for the GPU)."""
    from muser.attention.plan import SeqInput

    graphs = runner.graphs
    seq = runner.allocate()
    token = int(runner.forward([seq], [ids[:2048]])[-1].argmax())
    parts: dict[str, list[float]] = {}
    full = []
    for step in range(steps):
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        runner._reserve_pages(seq, seq.num_cached + 1)
        inputs = [SeqInput(seq.slot, seq.num_cached, 1, seq.ring, tuple(seq.page_ids))]
        t.append(time.perf_counter())
        graphs._replayed.synchronize()
        rings = graphs._pack(inputs, [token])
        t.append(time.perf_counter())
        graphs.graphs[1].replay()
        graphs._replayed.record()
        t.append(time.perf_counter())
        logits = graphs.buf.logits[1][:1].clone()
        seq.num_cached += 1
        seq.ring = rings[0]
        t.append(time.perf_counter())
        token = int(logits[-1].argmax())
        t.append(time.perf_counter())
        if step >= 10:
            for name, a, b in zip(("inputs", "pack", "replay_launch", "clone",
                                   "sample_and_wait"), t, t[1:]):
                parts.setdefault(name, []).append((b - a) * 1e6)
        t0 = time.perf_counter()
        token = int(runner.forward([seq], [[token]])[-1].argmax())
        if step >= 10:
            full.append((time.perf_counter() - t0) * 1e6)
    runner.free(seq)
    out = {k: statistics.median(v) for k, v in parts.items()}
    out["runner_forward_step"] = statistics.median(full)
    say("  decode step, median us: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()))
    return out


def down_sweep(cfg) -> dict:
    """The down projection (hidden x intermediate) at N=1 over a wider set of GEMV configs than
    `candidates`, each timed in CUDA graphs over rotating weights past L2."""
    from muser.ops.triton.gemv import GemvConfig, gemv
    from muser.ops.triton.linear import _cublas
    from muser.ops.triton.timing import graph_ms

    m, k = cfg.hidden_size, cfg.intermediate_size
    ws = [torch.randn(m, k, device=DEV, dtype=BF16) for _ in range(8)]
    x = torch.randn(1, k, device=DEV).to(BF16)
    out = {"cublas": graph_ms(lambda w: _cublas(x, w, False, None), ws) * 1e3}
    for kind, bm, bk, split, warps, stages in [
            ("fma", 4, 1024, 1, 4, 3), ("fma", 4, 1024, 1, 4, 4), ("fma", 4, 2048, 1, 8, 3),
            ("fma", 2, 2048, 1, 4, 3), ("fma", 4, 512, 2, 4, 4), ("fma", 4, 1024, 2, 4, 3),
            ("fma", 8, 512, 2, 4, 3), ("fma", 8, 512, 4, 4, 4), ("fma", 2, 1024, 2, 4, 3),
            ("fma", 4, 256, 4, 2, 4), ("dot", 32, 512, 4, 4, 4), ("dot", 16, 512, 4, 4, 3),
            ("dot", 64, 256, 8, 4, 4), ("dot", 32, 256, 8, 4, 5), ("dot", 16, 1024, 2, 4, 3)]:
        c = GemvConfig(kind, bm, bk, split, warps, stages)
        try:
            out[str(c)] = graph_ms(lambda w, c=c: gemv(x, w, c), ws) * 1e3
        except Exception as exc:  # noqa: BLE001  (a config that does not compile is skipped)
            out[str(c)] = f"{type(exc).__name__}"
    timed = sorted((v, c) for c, v in out.items() if isinstance(v, float))
    gbps = lambda us: m * k * 2 / us / 1e3
    say(f"  down {m}x{k} N=1: cuBLAS {out['cublas']:.2f} us ({gbps(out['cublas']):.0f} GB/s); "
        f"fastest {timed[0][1]} {timed[0][0]:.2f} us ({gbps(timed[0][0]):.0f} GB/s)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--models", default="gemma3-1b,gemma3-27b")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--step", action="store_true",
                    help="only gemma3-1b's decode step breakdown and the down-projection sweep")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.step:
        cfg = preset("gemma3-1b")
        weights = random_weights(cfg, BF16, DEV, seed=0)
        ids = torch.randint(0, cfg.vocab_size, (2048,),
                            generator=torch.Generator().manual_seed(1)).tolist()
        runner, _ = make_runner(cfg, weights, 4096)
        result = {"environment": environment(), "step_us": step_breakdown(runner, ids),
                  "down_sweep_us": down_sweep(cfg),
                  "prefill": {t: host_profile(runner, ids[:t]) for t in (512, 2048)}}
        (out_dir / "gpu_probe_step.json").write_text(json.dumps(result | {"log": LOG}, indent=1))
        return 0
    lengths = [int(t) for t in args.lengths.split(",")]
    result: dict = {"environment": environment(), "models": {}}
    hf_out = {"environment": result["environment"], "date": time.strftime("%Y-%m-%d"),
              "method": (Path(__file__).parent / "hf_compiled.py").read_text().split('"""')[1],
              "models": {}}

    def save() -> None:
        (out_dir / "gpu_probe.json").write_text(json.dumps(result | {"log": LOG}, indent=1))
        (out_dir / "hf_compiled.json").write_text(json.dumps(hf_out, indent=1))

    for name in args.models.split(","):
        say(f"{name}:")
        cfg = preset(name)
        weights = random_weights(cfg, BF16, DEV, seed=0)
        ids = torch.randint(0, cfg.vocab_size, (max(lengths),),
                            generator=torch.Generator().manual_seed(1)).tolist()
        res = result["models"][name] = {}
        runner, startup = make_runner(cfg, weights, max(lengths) + 128)
        res["startup_s"] = startup
        if name == "gemma3-1b":
            res["prefill"] = {t: host_profile(runner, ids[:t]) for t in (512, 2048)}
        from muser.ops.triton.linear import choices

        seq = runner.allocate()
        runner.forward([seq], [ids[:2048]])
        runner.forward([seq], [[5]])
        res["choices"] = choices()
        for shape, c in res["choices"].items():
            best = sorted(c["timed_ms"].items(), key=lambda kv: kv[1])[:3]
            say(f"  {shape}: runs {c['runs']}; fastest {best}")
        res["decode_kernels"] = _profile(runner.graphs.graphs[1].replay)
        runner.free(seq)
        save()
        del runner
        torch.cuda.empty_cache()
        model = hf_twin(cfg, weights, DEV, BF16, attn="sdpa")
        hf = hf_out["models"][name] = {}
        try:
            hf["decode"] = static_compile_decode(model, ids, 2048, args.decode_steps, say)
            say(f"  transformers static+compile decode: {hf['decode']['decode_s'] * 1e3:.3f} "
                f"ms/token")
        except Exception as exc:  # noqa: BLE001  (recorded, the probe goes on)
            hf["decode_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            say(f"  transformers static+compile decode failed: {hf['decode_error'][:300]}")
        save()
        torch._dynamo.reset()
        try:
            hf["prefill_s"] = compiled_prefill(model, ids, lengths, say)
        except Exception as exc:  # noqa: BLE001
            hf["prefill_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            say(f"  transformers compiled prefill failed: {hf['prefill_error'][:300]}")
        save()
        torch._dynamo.reset()
        del model, weights
        torch.cuda.empty_cache()
    say("done")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
