"""The CPU kernels (muser/ops/native/) against an earlier revision of their C sources, side by
side in one process, each timed alternately in both builds (best of --rounds) and the outputs
checked bitwise equal: projections (gemm.c) of one layer's four matrices of the embedded model
at 1 to 512 rows (decode batches, then prefill chunks) and of its tied LM head up to 16 rows;
attention (attention.c) of a 512-row chunk and of one decode row over 2,048 keys, global and
sliding (the model's window), and a decode step of 8 sequences in one call against the base
build's attention called per sequence.

    python bench/cpu_ab.py --base 2944a9b --out bench/results/cpu_ab.json

The baseline is built from `git show REV:muser/ops/native/...` with the same compiler and flags
(muser.ops.native.FLAGS) into a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from muser import LLM
from muser.bench import _cpu_model
from muser.ops import native

ROOT = Path(__file__).resolve().parent.parent
NATIVE = "muser/ops/native"


def build_base(rev: str, tmp: Path) -> ctypes.CDLL:
    """The kernel library of revision `rev`'s C sources."""
    for path in native.SOURCES + native.HEADERS:
        text = subprocess.run(["git", "show", f"{rev}:{NATIVE}/{path.name}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        (tmp / path.name).write_text(text)
    lib = tmp / "base.so"
    subprocess.run([os.environ.get("CC", "cc"), *native.FLAGS, "-o", str(lib),
                    *(str(tmp / p.name) for p in native.SOURCES), "-lm"], check=True)
    base = ctypes.CDLL(str(lib))
    for name in ("muser_gemm", "muser_attention"):
        getattr(base, name).argtypes = getattr(native.library(), name).argtypes
        getattr(base, name).restype = ctypes.c_int
    return base


@contextlib.contextmanager
def using(lib: ctypes.CDLL):
    """muser.ops.native's calls go through `lib` inside the block."""
    real = native.library
    native.library = lambda: lib
    try:
        yield
    finally:
        native.library = real


def attention_cells(llm: LLM, libs: dict, rounds: int) -> list[dict]:
    """native.attention in each build."""
    cfg, gen = llm.model_config, torch.Generator().manual_seed(0)
    cells = []
    for rows, keys in ((512, 2048), (1, 2048)):
        q = torch.randn(rows, cfg.num_heads, cfg.head_dim, generator=gen)
        k = torch.randn(keys, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        v = torch.randn(keys, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        for window in (None, cfg.sliding_window):
            reps, best, outs = (3 if rows > 1 else 100), dict.fromkeys(libs, float("inf")), {}
            for _ in range(rounds):
                for label, lib in libs.items():
                    start = time.perf_counter()
                    with using(lib):
                        for _ in range(reps):
                            outs[label] = native.attention(q, k, v, keys - rows, 0, window,
                                                           cfg.attn_scale)
                    best[label] = min(best[label], (time.perf_counter() - start) / reps)
            assert torch.equal(outs["muser"], outs["base"])
            cell = {"op": "attention", "rows": rows, "keys": keys, "window": window,
                    "muser_ms": best["muser"] * 1e3, "base_ms": best["base"] * 1e3,
                    "speedup": best["base"] / best["muser"]}
            cells.append(cell)
            print(f"attention rows {rows:3} keys {keys} window {window}: "
                  f"{cell['muser_ms']:8.3f} ms, base {cell['base_ms']:8.3f} ms "
                  f"({cell['speedup']:.2f}x)", flush=True)
    cells.append(decode_batch_cell(llm, libs, rounds))
    return cells


def decode_batch_cell(llm: LLM, libs: dict, rounds: int, seqs: int = 8, keys: int = 1024
                      ) -> dict:
    """A decode step's attention over `seqs` sequences of `keys` keys in 256-row pages: one
    native.decode_attention call (this build) against the base build's native.attention called
    per sequence, as muser.ops.cpu.decode_attention did before the batched call."""
    cfg, gen = llm.model_config, torch.Generator().manual_seed(2)
    pages = keys // 256
    k = torch.randn(seqs * pages * 256, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v = torch.randn(seqs * pages * 256, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    q = torch.randn(seqs, cfg.num_heads, cfg.head_dim, generator=gen)
    tables = torch.randperm(seqs * pages, generator=gen).to(torch.int32).view(seqs, pages)
    zeros, lens = torch.zeros(seqs, dtype=torch.int64), torch.full((seqs,), keys)

    def batched() -> torch.Tensor:
        return native.decode_attention(q, k, v, tables, zeros, lens, zeros, 256,
                                       cfg.attn_scale)

    def per_sequence() -> torch.Tensor:
        with using(libs["base"]):
            return torch.stack([native.attention(q[b : b + 1], k, v, keys - 1, 0, None,
                                                 cfg.attn_scale, (tables[b], 256, 0))[0]
                                for b in range(seqs)])

    runs, best, outs = {"muser": batched, "base": per_sequence}, {}, {}
    for _ in range(rounds):
        for label, fn in runs.items():
            start = time.perf_counter()
            for _ in range(20):
                outs[label] = fn()
            best[label] = min(best.get(label, float("inf")), (time.perf_counter() - start) / 20)
    assert torch.equal(outs["muser"], outs["base"])
    cell = {"op": "decode_attention", "sequences": seqs, "keys": keys,
            "muser_ms": best["muser"] * 1e3, "base_ms": best["base"] * 1e3,
            "speedup": best["base"] / best["muser"]}
    print(f"decode attention {seqs} sequences x {keys} keys: {cell['muser_ms']:8.3f} ms, base "
          f"{cell['base_ms']:8.3f} ms per sequence ({cell['speedup']:.2f}x)", flush=True)
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--rows", default="1,2,4,5,8,12,16,64,512")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--out", help="write the JSON receipt here")
    args = ap.parse_args()
    llm = LLM(progress=False, device="cpu", max_num_seqs=1, max_model_len=512)
    weights = llm.runner.model.weights
    layer = weights.layers[args.layer]
    mats = {"qkv": layer.qkv, "o_proj": layer.o_proj, "gate_up": layer.gate_up,
            "down": layer.down, "head": weights.head}
    flags = native._cpu_flags()
    build = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "portable"
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"muser": native.library(), "base": build_base(args.base, Path(tmp))}
        for name, w in mats.items():
            for n in map(int, args.rows.split(",")):
                if name == "head" and n > 16:  # the head projects one row a prompt
                    continue
                reps = 3 if name == "head" else max(3, 40 // n)
                x = torch.randn(n, w.shape[1], generator=torch.Generator().manual_seed(n))
                outs = {}
                for label, lib in libs.items():
                    with using(lib):
                        outs[label] = native.gemm(x, w)
                assert torch.equal(outs["muser"], outs["base"]), name
                best = dict.fromkeys(libs, float("inf"))
                for _ in range(args.rounds):
                    for label, lib in libs.items():
                        start = time.perf_counter()
                        with using(lib):
                            for _ in range(reps):
                                native.gemm(x, w)
                        best[label] = min(best[label], (time.perf_counter() - start) / reps)
                cell = {"op": "gemm", "matrix": name, "shape": list(w.shape), "rows": n,
                        "muser_ms": best["muser"] * 1e3, "base_ms": best["base"] * 1e3,
                        "speedup": best["base"] / best["muser"],
                        "muser_gb_s": w.nbytes() / best["muser"] / 1e9,
                        "muser_gflop_s": 2 * n * w.rows * w.shape[1] / best["muser"] / 1e9}
                cells.append(cell)
                print(f"{name:8} rows {n:3}: {cell['muser_ms']:8.3f} ms, base "
                      f"{cell['base_ms']:8.3f} ms ({cell['speedup']:.2f}x)", flush=True)
        cells += attention_cells(llm, libs, args.rounds)
    receipt = {"cpu": _cpu_model(), "build": build, "threads": torch.get_num_threads(),
               "base": args.base, "torch": torch.__version__, "cells": cells}
    if args.out:
        Path(args.out).write_text(json.dumps(receipt, indent=1))


if __name__ == "__main__":
    main()
