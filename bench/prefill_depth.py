"""A prefill chunk's attention at depth on a full-attention layer: the 512 rows of the chunk
over every key before them, read from a paged store (256-row pages in a random order), two ways
side by side — the key range gathered into a contiguous buffer first (ops.stage_gather, then
the flash kernel), or attended in place through the row list — each way per launch
configuration (key splits, warps, stages, query heads per program) and at the launch rule's.

    python bench/prefill_depth.py --out $OUT/prefill_depth.json

Per cell: time (median of CUDA-event timings), TFLOP/s of QK^T + PV (4 * T * S * H * D), and
the gather's bytes; the first depth checks both ways against ops.ref (float32) on the same rows.
The receipt is rewritten after every depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch
from cuda_events import bench_ms
from decode_depth import PAGE, SHAPES, say

from muser.attention.routes import Route
from muser.ops import ref
from muser.ops.tiles import classify_tiles
from muser.ops.triton.prefill_attention import FlashConfig, launch_config, prefill_attention
from muser.ops.triton.stage_gather import stage_gather

DEV, BF16, TILE = torch.device("cuda"), torch.bfloat16, 64


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def case(shape: str, depth: int, rows: int):
    heads, kv_heads, dim = SHAPES[shape]
    num_k = depth + rows
    pages = -(-num_k // PAGE)
    gen = torch.Generator(device=DEV).manual_seed(depth)
    k = torch.randn(pages * PAGE, kv_heads, dim, device=DEV, generator=gen).to(BF16)
    v = torch.randn(pages * PAGE, kv_heads, dim, device=DEV, generator=gen).to(BF16)
    q = torch.randn(rows, heads, dim, device=DEV, generator=gen)
    order = torch.randperm(pages, device=DEV, generator=gen)
    pos = torch.arange(num_k, device=DEV)
    read = order[pos // PAGE] * PAGE + pos % PAGE
    tiles = classify_tiles(depth, rows, 0, num_k, None, TILE, TILE).to(DEV)
    return q, k, v, read, tiles, dim ** -0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--depths", default="8192,32768,131072")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--pack", default="1,2", help="query heads per program (those dividing G)")
    ap.add_argument("--wide", default="1,2", help="key tiles per block in the FULL run")
    ap.add_argument("--shapes", default="gemma3-27b,gemma3-1b")
    args = ap.parse_args()
    receipt = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "rows": args.rows, "page_rows": PAGE, "tile": TILE, "cells": []}
    configs = [FlashConfig(*c) for c in itertools.product(ints(args.splits), ints(args.warps),
                                                          ints(args.stages), ints(args.pack),
                                                          ints(args.wide))]
    for shape in args.shapes.split(","):
        for depth in [d for d in ints(args.depths) if shape == "gemma3-27b" or d <= 32768]:
            receipt["cells"] += measure(shape, depth, args.rows, configs,
                                        receipt if depth == ints(args.depths)[0] else None)
            mine = [c for c in receipt["cells"] if c["model"] == shape and c["depth"] == depth
                    and "ms" in c]
            for way in ("gathered", "in place"):
                rule = next(c for c in mine if c["way"] == way and c["default"])
                best = min((c for c in mine if c["way"] == way), key=lambda c: c["ms"])
                say(f"{shape} {depth} {way}: the rule's launch {rule['ms']:.3f} ms "
                    f"({rule['tflop_s']:.0f} TFLOP/s), best {best['ms']:.3f} ms at splits "
                    f"{best['splits']} warps {best['num_warps']} stages {best['num_stages']} "
                    f"pack {best['pack']} wide {best['wide']}")
            args.out.write_text(json.dumps(receipt, indent=1) + "\n")
            torch.cuda.empty_cache()


def measure(shape: str, depth: int, rows: int, configs: list[FlashConfig],
            check: dict | None) -> list[dict]:
    """The cells of one depth; with `check`, both ways' error against the reference too."""
    heads, kv_heads, dim = SHAPES[shape]
    q, k, v, read, tiles, scale = case(shape, depth, rows)
    flops = 4 * rows * (depth + rows) * heads * dim

    def attend(keys, values, rows_read=None, cfg=None):
        return prefill_attention(q, keys, values, depth, 0, None, scale, tiles, TILE,
                                 Route.TILED, read_rows=rows_read, config=cfg)

    def gathered():
        return attend(*stage_gather(k, v, read))

    if check is not None:
        want = ref.prefill_attention(q, k.float()[read], v.float()[read], depth, 0, None, scale,
                                     None, TILE, Route.DENSE)
        for name, out in (("gathered", gathered()), ("in place", attend(k, v, read))):
            err = float((out.double() - want.double()).norm() / want.double().norm())
            check.setdefault("rel_err", {})[f"{shape} {name}"] = err
    default = {way: launch_config(-(-rows // TILE), heads, kv_heads, tiles.shape[1], dim, TILE,
                                  way == "in place") for way in ("gathered", "in place")}
    runs = []
    for cfg in [None, *configs]:
        if cfg is None or (heads // kv_heads) % cfg.pack == 0:
            runs += [("gathered", cfg, lambda cfg=cfg: attend(*stage_gather(k, v, read), cfg=cfg)),
                     ("in place", cfg, lambda cfg=cfg: attend(k, v, read, cfg))]
    cells = []
    for way, cfg, fn in runs:
        cell = {"model": shape, "depth": depth, "way": way, "default": cfg is None,
                **dataclasses.asdict(cfg or default[way])}
        try:
            ms = bench_ms(fn)
        except Exception as e:  # noqa: BLE001  (a configuration over the shared-memory limit)
            cell["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        else:
            cell.update(ms=ms, tflop_s=flops / (ms / 1e3) / 1e12)
            if way == "gathered":
                cell["gather_bytes"] = 2 * 2 * read.numel() * kv_heads * dim * 2
        cells.append(cell)
    return cells

if __name__ == "__main__":
    sys.exit(main())
