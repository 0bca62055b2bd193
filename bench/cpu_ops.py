"""The CPU kernels against torch on the embedded model's shapes, side by side in one run.

    python bench/cpu_ops.py --out bench/results/cpu_ops.json

Projections: muser's GEMM over the file's codes (`muser.ops.native.gemm`) against torch's
float32 GEMM on the same dequantized matrix (the ceiling of a dense float32 product here), at
512 rows (GFLOP/s) and 1 row (GB/s of weight bytes read). Attention: one 512-row chunk at the
end of a 2,048-key prefix, global and sliding (window 512), against torch's
scaled_dot_product_attention on the same masked problem. Median of --reps timings each.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from muser import LLM
from muser.ops import native


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def projections(llm: LLM, reps: int) -> list[dict]:
    layer = llm.runner.model.weights.layers[3]
    cells = []
    for name in ("qkv", "o_proj", "gate_up", "down"):
        w = getattr(layer, name)
        m, k = w.shape
        dense = w.dequantize()
        for rows in (512, 1):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            ours = _median_s(functools.partial(native.gemm, x, w), reps)
            theirs = _median_s(functools.partial(F.linear, x, dense), reps)
            cell = {"matrix": name, "shape": [m, k], "rows": rows, "muser_s": ours,
                    "torch_f32_s": theirs, "ratio_vs_torch": theirs / ours}
            if rows == 1:
                cell["muser_gb_s"] = w.nbytes() / ours / 1e9
            else:
                cell["muser_gflop_s"] = 2 * rows * m * k / ours / 1e9
                cell["torch_gflop_s"] = 2 * rows * m * k / theirs / 1e9
            cells.append(cell)
    return cells


def attention(llm: LLM, reps: int) -> list[dict]:
    cfg = llm.model_config
    gen = torch.Generator().manual_seed(0)
    rows, keys, d = 512, 2048, cfg.head_dim
    q = torch.randn(rows, cfg.num_heads, d, generator=gen)
    k = torch.randn(keys, cfg.num_kv_heads, d, generator=gen)
    v = torch.randn(keys, cfg.num_kv_heads, d, generator=gen)
    cells = []
    for window in (None, cfg.sliding_window):
        ours = _median_s(functools.partial(
            native.attention, q, k, v, keys - rows, 0, window, 0.0625), reps)
        pos_q = torch.arange(keys - rows, keys)[:, None]
        pos_k = torch.arange(keys)[None, :]
        mask = pos_k <= pos_q
        if window:
            mask &= pos_k > pos_q - window
        group = cfg.num_heads // cfg.num_kv_heads
        qt = q.transpose(0, 1)[None]
        kt = k.repeat_interleave(group, 1).transpose(0, 1)[None]
        vt = v.repeat_interleave(group, 1).transpose(0, 1)[None]
        theirs = _median_s(functools.partial(
            F.scaled_dot_product_attention, qt, kt, vt, attn_mask=mask, scale=0.0625), reps)
        cells.append({"window": window, "rows": rows, "keys": keys, "muser_s": ours,
                      "torch_sdpa_s": theirs, "ratio_vs_torch": theirs / ours})
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", help="write the JSON receipt here")
    args = ap.parse_args()
    llm = LLM(progress=False, device="cpu", max_num_seqs=1, max_model_len=4096)
    receipt = {"threads": torch.get_num_threads(), "torch": torch.__version__,
               "projections": projections(llm, args.reps), "attention": attention(llm, args.reps)}
    for cell in receipt["projections"] + receipt["attention"]:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in cell.items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(receipt, f, indent=2)


if __name__ == "__main__":
    main()
