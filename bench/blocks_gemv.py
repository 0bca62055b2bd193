"""The decode GEMV over GGUF blocks (muser/ops/triton/gemv_blocks.py) against the memory system:
for each block type and gemma3-27b decode shape at N = 1 and 8, every candidate config timed
(CUDA graphs over copies of the blocks that defeat L2, as the warm-up times them), the best
one's bytes read per second next to a 1 GiB device-to-device copy's (read + write) measured in
the same run, and the dense bf16 GEMV of the same shape (muser.ops.triton.gemv, its default
config). Q8_0 and the K-quants read x as int8 rows, made once per x (timed apart:
`int8_rows_us`).
`--baseline FILE` times an earlier version of gemv_blocks.py the same way, side by side
(`baseline_us`, `speedup`); `--explore` times a grid of tiles beyond the candidates. Outputs
are checked against the blocks dequantized to float32 and multiplied by torch in float32.

    git show REV:muser/ops/triton/gemv_blocks.py > /tmp/base.py
    python3 bench/blocks_gemv.py --baseline /tmp/base.py --out $OUT/blocks_gemv_h200.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import torch
import triton.testing
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from muser.ops.blocks import BlockMatrix, block_tensors
from muser.ops.triton.dequantize_blocks import dequantize_blocks
from muser.ops.triton.gemv import gemv
from muser.ops.triton.gemv_blocks import (
    BlockGemvConfig,
    candidates_blocks,
    default_config,
    linear_blocks,
)
from muser.ops.triton.int8_rows import int8_rows
from muser.ops.triton.launch import cdiv, next_power_of_2
from muser.ops.triton.timing import graph_ms, rotation

QT = GGMLQuantizationType
TYPES = [QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.Q5_0, QT.Q5_K, QT.Q4_0]
SHAPES = {"qkv": (8192, 5376), "o_proj": (5376, 4096), "gate_up": (43008, 5376),
          "down": (5376, 21504)}  # gemma3-27b: [M, K]
ROWS = (1, 8)
DEVICE = "cuda"
EXPLORE = [(8, 4, 4), (16, 4, 4), (32, 4, 4), (16, 2, 4), (32, 2, 4), (64, 2, 8), (32, 1, 4),
           (64, 1, 4), (16, 4, 2), (64, 4, 8), (128, 1, 8)]  # (block_m, blocks, warps)


def log(*args) -> None:
    print(*args, flush=True)


def random_blocks(qtype: QT, m: int, k: int, gen: torch.Generator) -> BlockMatrix:
    """Random codes and scale bytes, fp16 super-scales of small finite values (as the tests'
    _random_blocks), built on the GPU."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    nb = k // block_size
    raw = torch.randint(0, 256, (m, nb, type_size), generator=gen, dtype=torch.uint8,
                        device=DEVICE)
    halves = 2 if qtype in (QT.Q4_K, QT.Q5_K) else 1
    at = type_size - 2 if qtype == QT.Q6_K else 0
    scales = (torch.rand(m, nb, halves, generator=gen, device=DEVICE) - 0.5) * 0.02
    raw[..., at:at + 2 * halves] = scales.half().view(torch.uint8).view(m, nb, 2 * halves)
    return BlockMatrix.from_raw(raw.reshape(m, -1), qtype, (m, k))


def copy_gbps() -> float:
    """A 1 GiB device-to-device copy: 2 * bytes / time (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=40,
                                 return_mode="median") * 1e3
    return 2 * (1 << 30) / (us * 1e-6) / 1e9


def dense_us(x: torch.Tensor, m: int, k: int, gen: torch.Generator) -> float:
    """The dense GEMV of the same shape on a random bf16 matrix (its default config)."""
    dense = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
    copies = rotation(dense, dense.nbytes, torch.clone)
    return graph_ms(lambda w: gemv(x, w), copies) * 1e3


def explore(n: int, m: int, k: int, qtype: QT) -> list[BlockGemvConfig]:
    """EXPLORE's tiles (blocks counted in 256 values: Q8_0's 32-value blocks eight a 256), each
    split over K until about 1024 programs run."""
    out = []
    per_256 = 256 // GGML_QUANT_SIZES[qtype][0]
    for bm, nb, warps in ((bm, nb * per_256, warps) for bm, nb, warps in EXPLORE):
        blocks = k // GGML_QUANT_SIZES[qtype][0]
        if nb > blocks:
            continue
        split = min(next_power_of_2(cdiv(1024, cdiv(m, bm))), max(1, blocks // nb), 16)
        out.append(BlockGemvConfig(bm, nb, split, warps))
    return out


def time_configs(fn, configs, copies, expect, scale) -> list[dict]:
    """Each config: fn(w, config, out) timed over the rotating copies, checked on the first."""
    rows = []
    for config in dict.fromkeys(configs):
        try:
            out = torch.empty_like(expect)
            fn(copies[0], config, out)
            err = (out - expect).abs().max().item() / scale
            us = graph_ms(lambda w, c=config, o=out: fn(w, c, o), copies) * 1e3
            rows.append({"config": config.__dict__, "us": us, "rel_err": err})
        except Exception as exc:  # noqa: BLE001  (one failing config must not end the run)
            rows.append({"config": config.__dict__, "error": repr(exc)[:300]})
    return rows


def bench_shape(qtype: QT, name: str, m: int, k: int, n: int, copy: float,
                gen: torch.Generator, every: bool, base, wide: bool, base_layout: str) -> dict:
    """One shape: every candidate config (or only the default one, `every` False), EXPLORE's
    tiles too (`wide`), and the baseline module's candidates (`base`)."""
    w = random_blocks(qtype, m, k, gen)
    nbytes_w = sum(t.nbytes for t in block_tensors(w))  # the codes and any d kept apart
    copies = rotation(w, nbytes_w, BlockMatrix.clone)
    x = torch.randn(n, k, generator=gen, device=DEVICE).to(torch.bfloat16)
    expect = x.float() @ dequantize_blocks(w, torch.float32).t()
    scale = expect.abs().max().item()
    rows_x = int8_rows(x)
    nbytes = nbytes_w + x.numel() * x.element_size()
    configs = candidates_blocks(n, m, k, qtype) if every else [default_config(n, m, k, qtype)]
    if wide:
        configs += explore(n, m, k, qtype)
    rows = time_configs(lambda b, c, o: linear_blocks(x, b, c, out=o, rows=rows_x), configs,
                        copies, expect, scale)
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    try:
        dense, dense_err = dense_us(x, m, k, gen), None
    except Exception as exc:  # noqa: BLE001
        dense, dense_err = None, repr(exc)[:300]
    res = {"qtype": qtype.name, "shape": name, "m": m, "k": k, "n": n, "bytes": nbytes,
           "default": default_config(n, m, k, qtype).__dict__, "configs": rows,
           "dense_bf16_us": dense, "dense_bf16_bytes": m * k * 2 + x.numel() * 2}
    res["int8_rows_us"] = graph_ms(lambda _: int8_rows(x), [x]) * 1e3
    if dense_err:
        res["dense_error"] = dense_err
    if base is not None:  # reading the blocks as the file has them, or as BlockMatrix does
        files = copies if base_layout == "current" else [
            BlockMatrix(c.file_bytes(), c.qtype, c.cols, c.dtype) for c in copies]
        old = time_configs(lambda b, c, o: base.linear_blocks(x, b, base.BlockGemvConfig(
            **c.__dict__), out=o), base.candidates_blocks(n, m, k, qtype), files, expect, scale)
        res["baseline_configs"] = old
        old_timed = [r for r in old if "us" in r]
        if old_timed:
            res["baseline_us"] = min(r["us"] for r in old_timed)
    if best is not None:
        gbps = nbytes / (best["us"] * 1e-6) / 1e9
        res |= {"best": best["config"], "us": best["us"], "rel_err": best["rel_err"],
                "gbps": gbps, "copy_ratio": gbps / copy}
        if "baseline_us" in res:
            res["speedup"] = res["baseline_us"] / best["us"]
        log(f"{qtype.name:5} {name:8} n={n}  {best['us']:8.1f} us  {gbps:7.0f} GB/s "
            f"({gbps / copy:.2f} of copy)  err {best['rel_err']:.1e}  baseline "
            f"{res.get('baseline_us', float('nan')):.1f} us  x8 {res.get('int8_rows_us', 0):.1f}"
            f" us  dense bf16 {dense if dense is None else round(dense, 1)} us  best "
            f"{best['config']}")
    else:
        log(f"{qtype.name:5} {name:8} n={n}  every config failed: {rows[0].get('error')}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--types", default=",".join(t.name for t in TYPES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="x rows to time")
    ap.add_argument("--budget", type=float, default=150,
                    help="seconds after which only the default config is timed (compiles "
                         "dominate: each candidate is its own kernel)")
    ap.add_argument("--baseline", help="an earlier gemv_blocks.py to time side by side")
    ap.add_argument("--baseline-layout", choices=["file", "current"], default="file",
                    help="the blocks the baseline reads: the file's bytes, or BlockMatrix's")
    ap.add_argument("--explore", action="store_true", help="time EXPLORE's tiles too")
    args = ap.parse_args()
    base = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("gemv_blocks_base", args.baseline)
        base = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    start = time.time()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    copy = copy_gbps()
    torch.cuda.empty_cache()
    log(f"{torch.cuda.get_device_name()}: 1 GiB device copy {copy:.0f} GB/s (read + write)")
    results = []
    for qtype in (QT[t] for t in args.types.split(",")):
        for name in args.shapes.split(","):
            m, k = SHAPES[name]
            for n in map(int, args.rows.split(",")):
                try:
                    every = time.time() - start < args.budget
                    results.append(bench_shape(qtype, name, m, k, n, copy, gen, every, base,
                                               args.explore and every, args.baseline_layout))
                except Exception as exc:  # noqa: BLE001
                    log(f"{qtype.name} {name} n={n} failed: {exc!r}")
                    results.append({"qtype": qtype.name, "shape": name, "n": n,
                                    "error": repr(exc)[:300]})
                torch.cuda.empty_cache()
    log(f"done in {time.time() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": copy,
                       "baseline": args.baseline, "command": " ".join(sys.argv),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
