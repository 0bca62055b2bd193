"""torch._scaled_mm (rowwise scales, the FP8 prefill route's call) with the tensor cores' fast
accumulation against float32 accumulation (use_fast_accum True / False), on gemma3-27b's four
projection shapes at 512 and 2,048 rows: ms per call (30 calls after one, CUDA events).

    python3 bench/scaled_mm_accum.py $OUT/scaled_mm_accum.json
"""

import json
import sys

import torch


def ms(fn, it=30):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(it):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / it


out = {}
for m, k in ((8192, 5376), (5376, 4096), (43008, 5376), (5376, 21504)):
    w = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    sb = torch.rand(1, m, device="cuda")
    for n in (512, 2048):
        x = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.rand(n, 1, device="cuda")
        r = {f: ms(lambda f=f, x=x, w=w, sa=sa, sb=sb: torch._scaled_mm(
                 x, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=f))
             for f in (True, False)}
        out[f"{m}x{k} rows={n}"] = {"fast_ms": r[True], "float32_accum_ms": r[False],
                                    "speedup": r[False] / r[True]}
        print(f"{m}x{k} rows={n}: fast {r[True]*1e3:.1f} us, f32 accum {r[False]*1e3:.1f} us "
              f"({r[False]/r[True]:.3f}x)", flush=True)
with open(sys.argv[1], "w") as fh:
    json.dump(out, fh, indent=1)
