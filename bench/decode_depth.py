"""Split-KV decode attention at depth: time, achieved bandwidth and the fraction of the copy
bandwidth measured in the same run, per launch configuration (splits, keys per iteration,
warps, pipeline stages), for the full-attention layers of gemma3-27b and gemma3-1b at batch 1.

    python bench/decode_depth.py --out $OUT/decode_depth.json

A cell reads `keys` rows of K and V (bf16) through a page table of 256-row pages in a random
order (a fragmented pool), and is checked against ops.ref.decode_attention on the first depth.
With --new the kernel also stores the step's new row and attends it, as a decode step does
(`new=`); --graph times replays of a CUDA graph of the call (as the step runs it: no launch
cost) instead of eager calls. The receipt is rewritten after every cell (a bounded run keeps
what it measured).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
from cuda_events import bench_ms, copy_bandwidth
from triton.errors import TritonError

from muser.ops import ref
from muser.ops.triton.decode_attention import decode_attention, launch_config
from muser.ops.triton.timing import graph_ms

DEV, BF16, PAGE = torch.device("cuda"), torch.bfloat16, 256
SHAPES = {"gemma3-27b": (32, 16, 128), "gemma3-1b": (4, 1, 256)}  # heads, kv heads, head dim


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def case(shape: str, keys: int, max_keys: int):
    heads, kv_heads, dim = SHAPES[shape]
    pages = -(-max_keys // PAGE)
    gen = torch.Generator(device=DEV).manual_seed(keys)
    k = torch.randn(pages * PAGE, kv_heads, dim, device=DEV, generator=gen).to(BF16)
    v = torch.randn(pages * PAGE, kv_heads, dim, device=DEV, generator=gen).to(BF16)
    q = torch.randn(1, heads, dim, device=DEV, generator=gen).to(BF16)
    table = torch.randperm(pages, device=DEV, generator=gen).to(torch.int32)[None]
    zero = torch.zeros(1, dtype=torch.int32, device=DEV)
    lens = torch.full((1,), keys, dtype=torch.int32, device=DEV)
    return q, k, v, table, zero, lens, zero, dim ** -0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--depths", default="2048,8192,32768,131072")
    ap.add_argument("--max-keys", type=int, default=131072, help="the page table's width")
    ap.add_argument("--splits", default="16,32,64,128")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--shapes", default="gemma3-27b,gemma3-1b")
    ap.add_argument("--new", action="store_true", help="store and attend the step's new row")
    ap.add_argument("--graph", action="store_true", help="time CUDA graph replays")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]
    copy_bw = copy_bandwidth(2 << 30)
    receipt = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "copy_bytes_per_s": copy_bw, "page_rows": PAGE, "new_row": args.new,
               "timing": "cuda graph replay" if args.graph else "eager", "cells": []}
    say(f"copy {copy_bw / 1e12:.2f} TB/s (read + write)")
    configs = list(itertools.product(ints(args.splits), ints(args.block_n), ints(args.warps),
                                     ints(args.stages)))
    for shape in args.shapes.split(","):
        _heads, kv_heads, dim = SHAPES[shape]
        max_keys = args.max_keys if shape == "gemma3-27b" else min(args.max_keys, 32768)
        for depth in [d for d in ints(args.depths) if d <= max_keys]:
            q, k, v, table, starts, lens, origins, scale = case(shape, depth, max_keys)
            nbytes = 2 * depth * kv_heads * dim * 2
            new = None
            if args.new:  # the newest key's row comes from the step's own K/V
                dst = (table[0, (depth - 1) // PAGE] * PAGE + (depth - 1) % PAGE).reshape(1)
                new = (k[dst].clone(), v[dst].clone(), torch.zeros_like(dst), dst)
            want = None
            if depth == ints(args.depths)[0]:
                want = ref.decode_attention(q.float(), k.float(), v.float(), table, starts, lens,
                                            origins, PAGE, scale)
            default = launch_config(1, kv_heads, dim, table.shape[1] * PAGE)
            for splits, block_n, warps, stages in [(None, None, None, None), *configs]:
                run = functools.partial(decode_attention, q, k, v, table, starts, lens, origins,
                                        PAGE, scale, new=new, splits=splits, block_n=block_n,
                                        num_warps=warps, num_stages=stages)
                cell = {"model": shape, "keys": depth, "splits": splits or default[0],
                        "block_n": block_n or default[1], "num_warps": warps or default[2],
                        "num_stages": stages or default[3],
                        "default": splits is None, "bytes": nbytes}
                try:
                    out = run()
                    if want is not None:
                        cell["rel_err"] = float((out.double() - want.double()).norm()
                                                / want.double().norm())
                    ms = (graph_ms(lambda _, run=run: run(), [None], reps=10) if args.graph
                          else bench_ms(run))
                except (TritonError, RuntimeError) as e:  # NOTE: a config over the shared memory
                    cell["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                    say(f"{shape} {depth} {cell}")
                    receipt["cells"].append(cell)
                    continue
                cell.update(us=ms * 1e3, bytes_per_s=nbytes / (ms / 1e3),
                            fraction_of_copy=nbytes / (ms / 1e3) / copy_bw)
                receipt["cells"].append(cell)
            best = min((c for c in receipt["cells"] if c["model"] == shape and c["keys"] == depth
                        and "us" in c), key=lambda c: c["us"])
            base = next(c for c in receipt["cells"] if c["model"] == shape and c["keys"] == depth
                        and c["default"])
            say(f"{shape} {depth} keys: default {base['us']:.1f} us "
                f"({base['fraction_of_copy']:.2f} of copy), best {best['us']:.1f} us "
                f"({best['fraction_of_copy']:.2f}) at splits {best['splits']} block_n "
                f"{best['block_n']} warps {best['num_warps']} stages {best['num_stages']}")
            args.out.write_text(json.dumps(receipt, indent=1) + "\n")
            del q, k, v, run  # run holds q, k and v too
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
