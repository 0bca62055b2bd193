"""One device call: check every Triton kernel at real shapes, check the model on the GPU against
a float64 reference, and benchmark decode and prefill side by side with transformers.

    python bench/gpu_bench.py --out $OUT            # everything
    python bench/gpu_bench.py --models gemma3-1b --skip-correctness

Writes gpu_bench.json (environment, ceilings, kernel checks, correctness, one object per
benchmark cell) and gpu_bench.png (fractions of the measured ceilings).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from triton.errors import TritonError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package

from cuda_events import bench_ms, copy_bandwidth
from hf_compiled import compiled_prefill_calls
from hf_twin import hf_twin

import muser.ops.triton as tops
from muser.attention.routes import Route
from muser.config import EngineConfig
from muser.graph.weights import random_weights
from muser.ops import ref
from muser.ops.dense_ref import attention_dense
from muser.ops.tiles import classify_tiles
from muser.ops.triton import switches
from muser.ops.triton.gemm import CANDIDATES as GEMM_CANDIDATES
from muser.ops.triton.gemm import gemm
from muser.ops.triton.gemv import NormEpilogue
from muser.presets import preset
from muser.runner import Runner
from muser.startup.start import start as start_runner

T0 = time.perf_counter()
DEV = "cuda"
PREFILL_REPS = 10  # timed reps per prefill length (after one warm-up), median reported
BF16 = torch.bfloat16
LOG: list[str] = []


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)
    LOG.append(msg)


# ---------------------------------------------------------------- ceilings
def ceilings() -> dict:
    copy_bw = copy_bandwidth(4 << 30)
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    ms = bench_ms(lambda: a @ b, reps=10)
    flops = 2 * 8192**3 / (ms / 1e3)
    say(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s (read+write), bf16 GEMM 8192^3 "
        f"{flops / 1e12:.0f} TFLOP/s")
    return {"copy_bytes_per_s": copy_bw, "gemm_bf16_flops_per_s": flops}


# ---------------------------------------------------------------- kernel checks
def rel_err(out: torch.Tensor, expect: torch.Tensor) -> float:
    out, expect = out.double(), expect.double()
    if out.isnan().any():
        return float("inf")
    return ((out - expect).norm() / expect.norm().clamp_min(1e-30)).item()


def ulp_band_excess(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                    post: torch.Tensor, eps: float) -> float:
    """The fused residual add after a projection y = x @ w.T (rounded to bf16 before the add),
    checked element by element: max over elements of |got - want| / band, <= 1 when every
    element is within its band. The kernel's float32 sum differs from float64 by about
    sqrt(K) * 2^-24 * sum_k |x_k w_k| (a probabilistic bound); rounded to bf16, y then moves by
    up to one bf16 ulp more (where the two sums straddle a rounding boundary). The band is that
    change of y times its norm's scale and |post|, plus float32 slack."""
    xd, wd = x.double(), w.double()
    proj = (xd @ wd.t()).to(BF16).double()
    inv = (proj.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    ulp = torch.exp2(torch.floor(torch.log2(proj.abs().clamp_min(1e-30))) - 7)
    acc = w.shape[1] ** 0.5 * 2.0**-24 * (xd.abs() @ wd.abs().t())
    band = (ulp + acc) * inv * post.abs() + 1e-6 * (want.abs() + 1)
    got = got.double()
    if got.isnan().any():
        return float("inf")
    return ((got - want).abs() / band).max().item()


@switches.switched(poison=True)
def check_kernels(cfg, gen: torch.Generator) -> list[dict]:
    """Each op at `cfg`'s real shapes vs float64, outputs poisoned (NaN) before each run."""
    rows = []
    h, i, q, kv, d = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    rn = lambda *s, dt=torch.float32, sc=1.0: (
        torch.randn(*s, generator=gen, device=DEV) * sc).to(dt)

    def record(op: str, shape, err: float, tol: float) -> None:
        rows.append({"op": op, "shape": str(shape), "rel_err": err, "tol": tol,
                     "ok": bool(err <= tol)})
        say(f"  check {op:<28} {shape!s:<34} rel_err {err:.2e} (tol {tol:.0e}) "
            f"{'ok' if err <= tol else 'FAIL'}")

    lin_tol = 1e-2  # bf16 output rounding (~4e-3) over float64
    for name, m, k in [("qkv", q + 2 * kv, h), ("o_proj", h, q), ("gate_up", 2 * i, h)]:
        w = rn(m, k, dt=BF16, sc=k**-0.5)
        for n in (1, 4):
            x = rn(n, k)
            expect = x.to(BF16).double() @ w.double().t()
            record(f"gemv {name} N={n}", (m, k), rel_err(tops.linear(x, w), expect), lin_tol)
        x = rn(512, k)
        record(f"gemm {name} N=512", (m, k),
               rel_err(tops.linear(x, w), x.to(BF16).double() @ w.double().t()), lin_tol)
    w = rn(2 * i, h, dt=BF16, sc=h**-0.5)
    for n in (1, 4):
        x = rn(n, h)
        proj = (x.to(BF16).double() @ w.double().t()).to(BF16).double()
        record(f"gemv gate_up+geglu N={n}", (2 * i, h),
               rel_err(tops.linear_geglu(x, w), ref.geglu(proj)), lin_tol)
    def check_norm(kind: str, name: str, w: torch.Tensor, n: int, project) -> None:
        """project(x, w, norm epilogue) -> (new residual, normed): both vs float64."""
        m, k = w.shape
        x, res = rn(n, k, dt=BF16), rn(n, m, sc=3.0)
        post, nxt = 1 + rn(m, sc=0.1), 1 + rn(m, sc=0.1)
        got = project(x, w, NormEpilogue(res, post, nxt, 1e-6, BF16))
        proj = (x.double() @ w.double().t()).to(BF16).double()
        want = ref.add_rms_norm(res.double(), proj, post.double(), nxt.double(), 1e-6)
        record(f"{kind} {name}+add_rms_norm N={n} (res, in band)", (m, k),
               ulp_band_excess(got[0], want[0], x, w, post.double(), 1e-6), 1.0)
        record(f"{kind} {name}+add_rms_norm N={n} (out)", (m, k), rel_err(got[1], want[1]),
               lin_tol)

    def linear_norm(x, w, e):
        return tops.linear_add_rms_norm(x, w, e.residual, e.post, e.next, e.eps, e.dtype)

    for name, m, k in [("o_proj", h, q), ("down", h, i)]:
        w = rn(m, k, dt=BF16, sc=k**-0.5)
        for n in (1, 4, 64):
            check_norm("gemv" if n <= 8 else "linear", name, w, n, linear_norm)
    # each prefill GEMM config the projections may pick, with each epilogue, at a width no
    # tile divides
    n = 300
    for c in GEMM_CANDIDATES:
        kind = f"gemm {c.block_n}x{c.block_m}x{c.block_k}"
        x = rn(n, h, dt=BF16)
        w = rn(q + 2 * kv, h, dt=BF16, sc=h**-0.5)
        record(f"{kind} qkv N={n}", tuple(w.shape),
               rel_err(gemm(x, w, c), x.double() @ w.double().t()), lin_tol)
        w = rn(2 * i, h, dt=BF16, sc=h**-0.5)
        proj = (x.double() @ w.double().t()).to(BF16).double()
        record(f"{kind} gate_up+geglu N={n}", tuple(w.shape),
               rel_err(gemm(x, w, c, geglu=True), ref.geglu(proj)), lin_tol)
        for name, m, k in [("o_proj", h, q), ("down", h, i)]:
            check_norm(kind, name, rn(m, k, dt=BF16, sc=k**-0.5), n,
                       lambda x, w, e, c=c: gemm(x, w, c, norm=e))
    gate_up = rn(64, 2 * i, dt=BF16)
    record("geglu", (64, 2 * i), rel_err(tops.geglu(gate_up), ref.geglu(gate_up.double())),
           lin_tol)
    res, x = rn(7, h, sc=3.0), rn(7, h, dt=BF16)
    post, nxt = 1 + rn(h, sc=0.1), 1 + rn(h, sc=0.1)
    got = tops.add_rms_norm(res, x, post, nxt, 1e-6)
    want = ref.add_rms_norm(res.double(), x.double(), post.double(), nxt.double(), 1e-6)
    record("add_rms_norm (residual)", (7, h), rel_err(got[0], want[0]), 1e-5)
    record("add_rms_norm (normed)", (7, h), rel_err(got[1], want[1]), 1e-5)
    qkv = rn(5, q + 2 * kv, dt=BF16)
    x = qkv[:, :q].view(5, cfg.num_heads, d)
    wq = 1 + rn(d, sc=0.1)
    pos = torch.tensor([0, cfg.sliding_window - 1, cfg.sliding_window, 2 * cfg.sliding_window + 3,
                        8191], device=DEV)
    cos, sin = ref.rope_cos_sin(pos, d, cfg.rope_theta, cfg.rope_scaling_factor)
    far = torch.randint(0, 131072, (64,), generator=gen, device=DEV)
    # float64 cos/sin of the float32 angles the reference computes (positions * inv_freq)
    angles = (far.float()[:, None] * tops.rope.inv_freq(d, cfg.rope_theta,
                                                        cfg.rope_scaling_factor, DEV)).double()
    got = tops.rope_cos_sin(far, d, cfg.rope_theta, cfg.rope_scaling_factor)
    record("rope_cos_sin cos (pos < 131072)", (64, d // 2), rel_err(got[0], angles.cos()), 1e-5)
    record("rope_cos_sin sin (pos < 131072)", (64, d // 2), rel_err(got[1], angles.sin()), 1e-5)
    record("qk_norm_rope", tuple(x.shape),
           rel_err(tops.qk_norm_rope(x, wq, cos, sin, 1e-6),
                   ref.qk_norm_rope(x.double(), wq.double(), cos.double(), sin.double(), 1e-6)),
           1e-5)
    # the pair, keys in the cache dtype and stored with the values at their cache rows
    k = qkv[:, q:q + kv].view(5, cfg.num_kv_heads, d)
    v = qkv[:, q + kv:].view(5, cfg.num_kv_heads, d)
    wk = 1 + rn(d, sc=0.1)
    k_rows, v_rows = rn(64, cfg.num_kv_heads, d, dt=BF16), rn(64, cfg.num_kv_heads, d, dt=BF16)
    k_want, v_want = k_rows.double(), v_rows.clone()
    dst = torch.tensor([9, -1, 0, 63, 17], device=DEV)
    got_q, got_k = tops.qk_norm_rope_pair(x, k, wq, wk, cos, sin, 1e-6, BF16,
                                          (k_rows, v_rows, v, dst))
    want_q, want_k = ref.qk_norm_rope_pair(x.double(), k.double(), wq.double(), wk.double(),
                                           cos.double(), sin.double(), 1e-6, torch.float64,
                                           (k_want, v_want, v, dst))
    record("qk_norm_rope_pair q", tuple(x.shape), rel_err(got_q, want_q), 1e-5)
    record("qk_norm_rope_pair k (bf16)", tuple(k.shape), rel_err(got_k, want_k), lin_tol)
    record("qk_norm_rope_pair k stored", tuple(k_rows.shape), rel_err(k_rows, k_want), lin_tol)
    record("qk_norm_rope_pair v stored (bitwise)", tuple(v_rows.shape),
           0.0 if torch.equal(v_rows, v_want) else 1.0, 0.0)
    rows += check_cache_ops(cfg, rn, record)
    return rows


def check_cache_ops(cfg, rn, record) -> list[dict]:
    kvh, d, window = cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window
    # store_kv / stage_gather: exact copies.
    k_rows, v_rows = rn(4 * window, kvh, d, dt=BF16), rn(4 * window, kvh, d, dt=BF16)
    new = rn(9, kvh + 2, d)
    kn, vn = new[:, :kvh], new[:, 2:2 + kvh]
    src = torch.arange(9, device=DEV)
    dst = torch.randperm(4 * window, device=DEV)[:9]
    dst[3] = -1
    k2, v2 = k_rows.clone(), v_rows.clone()
    tops.store_kv(k_rows, v_rows, kn, vn, src, dst)
    ref.store_kv(k2, v2, kn, vn, src, dst)
    record("store_kv (bitwise)", tuple(kn.shape), 0.0 if torch.equal(k_rows, k2) and torch.equal(
        v_rows, v2) else 1.0, 0.0)
    read = (torch.arange(window - 1, device=DEV) + 100) % window + window  # a wrapped ring tail
    got = tops.stage_gather(k_rows, v_rows, read, kn, vn)
    want = ref.stage_gather(k_rows, v_rows, read, kn, vn)
    record("stage_gather (bitwise)", tuple(got[0].shape),
           0.0 if torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) else 1.0, 0.0)
    attn_tol = 2e-2  # bf16 q/k/v/p on tensor cores vs float64
    scale = cfg.attn_scale
    # decode: a wrapped ring (sliding) and a shuffled page table (global), 2 sequences + padding.
    ctx, ps = 2048, 256
    pages = torch.randperm(3 * ctx // ps, device=DEV)[: 2 * ctx // ps].view(2, -1).int()
    kc, vc = rn(3 * ctx, kvh, d, dt=BF16), rn(3 * ctx, kvh, d, dt=BF16)
    qd = rn(3, cfg.num_heads, d)
    for label, table, starts, lens, origins, bs in [
        ("decode ring (wrapped)", torch.tensor([[1], [3], [0]], device=DEV).int(),
         [0, 0, 0], [window, window // 3, 0], [window // 2 + 7, 0, 0], window),
        ("decode pages", torch.cat((pages, pages[:1])), [0, 0, 0], [ctx, 777, 0], [0, 0, 0], ps),
    ]:
        t = lambda v: torch.tensor(v, device=DEV, dtype=torch.int32)
        args = (qd, kc, vc, table.contiguous(), t(starts), t(lens), t(origins), bs, scale)
        # the step's new rows, stored by the kernel as each sequence's newest key
        kn, vn = rn(3, kvh, d), rn(3, kvh, d)
        dst = [int(ref.decode_rows(table[b], starts[b], lens[b], origins[b], bs)[-1])
               for b in range(2)] + [-1]
        new = (kn, vn, t([0, 1, 2]), t(dst))
        kc_want, vc_want = kc.clone(), vc.clone()
        ref.store_kv(kc_want, vc_want, *new)
        got = tops.decode_attention(*args, new=new)
        record(f"{label}: new rows stored (bitwise)", (2, kvh, d),
               0.0 if torch.equal(kc, kc_want) and torch.equal(vc, vc_want) else 1.0, 0.0)
        want = torch.zeros(qd.shape, dtype=torch.float64, device=DEV)
        for b in range(2):
            rows_ = ref.decode_rows(table[b], starts[b], lens[b], origins[b], bs)
            p = torch.arange(len(rows_), device=DEV)
            want[b] = attention_dense(qd[b:b + 1].double(), kc[rows_].double(),
                                      vc[rows_].double(), p[-1:], p, None, scale,
                                      torch.float64)[0]
        ok_pad = bool((got[2] == 0).all())
        record(label, (3, cfg.num_heads, d), rel_err(got, want) if ok_pad else 1.0, attn_tol)
    # prefill: a causal 2048-row chunk, and a staging shadow (window tail + 2048-row chunk).
    for label, q_start, k_start, win in [("flash causal", 0, 0, None),
                                         ("flash window (staging)", 3000, 3000 - window + 1,
                                          window)]:
        t_rows = 2048
        num_k = q_start - k_start + t_rows
        qp = rn(t_rows, cfg.num_heads, d)
        kp, vp = rn(num_k, kvh, d, dt=BF16), rn(num_k, kvh, d, dt=BF16)
        tiles = classify_tiles(q_start, t_rows, k_start, num_k, win, 64, 64).to(DEV)
        got = tops.prefill_attention(qp, kp, vp, q_start, k_start, win, scale, tiles, 64,
                                     Route.TILED)
        qpos = torch.arange(q_start, q_start + t_rows, device=DEV)
        kpos = torch.arange(k_start, k_start + num_k, device=DEV)
        want = attention_dense(qp.double(), kp.double(), vp.double(), qpos, kpos, win, scale,
                               torch.float64)
        record(label, (t_rows, num_k, cfg.num_heads, d), rel_err(got, want), attn_tol)
    # a chunk with nothing cached before it: its own rows, values strided in the QKV output
    width = (cfg.num_heads + 2 * kvh) * d
    vp = rn(2048, width, dt=BF16)[:, width - kvh * d:].view(2048, kvh, d)
    kp, qp = rn(2048, kvh, d, dt=BF16), rn(2048, cfg.num_heads, d)
    tiles = classify_tiles(0, 2048, 0, 2048, window, 64, 64).to(DEV)
    got = tops.prefill_attention(qp, kp, vp, 0, 0, window, scale, tiles, 64, Route.TILED)
    pos = torch.arange(2048, device=DEV)
    want = attention_dense(qp.double(), kp.double(), vp.double(), pos, pos, window, scale,
                           torch.float64)
    record("flash window (own rows, strided v)", (2048, 2048, cfg.num_heads, d),
           rel_err(got, want), attn_tol)
    return []


def gemv_bandwidth(cfg) -> list[dict]:
    """Decode projection at N=1 on the model's matrices: the chosen path (Triton GEMV or cuBLAS,
    see ops/triton/linear.py) vs cuBLAS alone, both timed in CUDA graphs, weights rotated past
    L2; and every Triton candidate config checked against float64 on the first matrix."""
    from muser.ops.triton.gemv import NormEpilogue, candidates, gemv
    from muser.ops.triton.linear import PICKS, _cublas, _key
    from muser.ops.triton.timing import graph_ms

    out = []
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    for name, m, k, epi in [("qkv", q + 2 * kv, h, ""), ("o_proj+norm", h, q, "norm"),
                            ("gate_up+geglu", 2 * i, h, "geglu"), ("down+norm", h, i, "norm"),
                            ("lm_head", cfg.vocab_size, h, "")]:
        nbytes = m * k * 2
        copies = max(1, min(8, math.ceil(384e6 / nbytes)))
        ws = [torch.randn(m, k, device=DEV, dtype=BF16) * k**-0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=DEV).to(BF16)  # the model feeds bf16 to every projection
        norm = NormEpilogue(torch.randn(1, m, device=DEV), 1 + 0.1 * torch.randn(m, device=DEV),
                            1 + 0.1 * torch.randn(m, device=DEV), 1e-6, BF16)
        ours = {"": lambda w, x=x: tops.linear(x, w),
                "geglu": lambda w, x=x: tops.linear_geglu(x, w),
                "norm": lambda w, x=x, norm=norm: tops.linear_add_rms_norm(
                    x, w, norm.residual, norm.post, norm.next, 1e-6, BF16)}[epi]
        ours(ws[0])  # picks the path for this shape
        t_ours = graph_ms(ours, ws)
        epi_args = (epi == "geglu", norm if epi == "norm" else None)
        t_cublas = graph_ms(lambda w, x=x, epi_args=epi_args: _cublas(x, w, *epi_args), ws)
        choice = PICKS.pick[_key(x, ws[0], epi)]
        row = {"matrix": name, "shape": [m, k], "chosen": "cublas" if choice is None else
               str(choice), "chosen_GBps": nbytes / t_ours / 1e6,
               "cublas_GBps": nbytes / t_cublas / 1e6}
        if name in ("qkv", "gate_up+geglu", "down+norm"):
            proj = (x.to(BF16).double() @ ws[0].double().t()).to(BF16).double()
            want = {"": proj, "geglu": ref.geglu(proj),
                    "norm": ref.add_rms_norm(norm.residual.double(), proj, norm.post.double(),
                                             norm.next.double(), 1e-6)[1]}[epi]
            errs = []
            for c in candidates(1, m, k):
                try:
                    got = gemv(x, ws[0], c, *epi_args)
                except (TritonError, RuntimeError):  # out of shared memory: never picked
                    continue
                errs.append(rel_err(got[1] if epi == "norm" else got, want))
            row["all_configs_max_rel_err"] = max(errs)
        say(f"  decode {name:<11} {m}x{k}: chosen {row['chosen_GBps']:.0f} GB/s "
            f"[{row['chosen']}], cuBLAS {row['cublas_GBps']:.0f} GB/s"
            + (f", all configs max rel err {row['all_configs_max_rel_err']:.1e}"
               if "all_configs_max_rel_err" in row else ""))
        out.append(row)
        del ws
    return out


def attention_sweep(cfg) -> list[dict]:
    """Decode attention at batch 1 (new row stored in the launch, as the model runs it) over a
    full sliding ring and a 2,080-key global cache: microseconds per layer for each split
    count and key block, timed in CUDA graphs (the default is launch_config's pick)."""
    from muser.ops.triton.decode_attention import launch_config
    from muser.ops.triton.timing import graph_ms

    out = []
    kvh, d, h = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    for label, keys, bs in [("sliding", cfg.sliding_window, cfg.sliding_window),
                            ("global", 2080, 16)]:
        rows = -(-keys // bs) * bs
        kc, vc = (torch.randn(rows, kvh, d, device=DEV).to(BF16) for _ in range(2))
        q, kn, vn = (torch.randn(1, n, d, device=DEV) for n in (h, kvh, kvh))
        table = torch.arange(rows // bs, device=DEV, dtype=torch.int32)[None]
        t = lambda v: torch.tensor([v], device=DEV, dtype=torch.int32)
        meta = (table, t(0), t(keys), t(0), bs, cfg.attn_scale)
        new = (kn, vn, t(0), t(keys - 1))
        default = launch_config(1, kvh, d, table.shape[1] * bs)
        for splits in (1, 2, 4, 8, 16, 32, 64):
            for block_n in (32, 64):
                fn = lambda w, s=splits, b=block_n, q=q, vc=vc, meta=meta, new=new: (
                    tops.decode_attention(q, w, vc, *meta, new=new, splits=s, block_n=b))
                us = graph_ms(fn, [kc]) * 1e3
                out.append({"layer": label, "keys": keys, "splits": splits, "block_n": block_n,
                            "us": us, "default": (splits, block_n) == default[:2]})
        best = min((r for r in out if r["layer"] == label), key=lambda r: r["us"])
        dflt = next(r for r in out if r["layer"] == label and r["default"])
        say(f"  decode attention {label} ({keys} keys): default {dflt['splits']} splits "
            f"{dflt['us']:.1f} us; best {best['splits']} splits, BLOCK_N {best['block_n']}: "
            f"{best['us']:.1f} us")
    return out


# ---------------------------------------------------------------- the model on the GPU
def make_runner(cfg, weights, max_len: int, eager: bool = False) -> tuple[Runner, float]:
    engine = EngineConfig.for_device(device=DEV, max_num_seqs=1, max_model_len=max_len,
                                     prefill_chunk=max_len, enforce_eager=eager)
    t0 = time.perf_counter()
    runner = start_runner(cfg, engine, weights)
    torch.cuda.synchronize()
    return runner, time.perf_counter() - t0


def prefill_logits(runner: Runner, ids: list[int], chunk: int, positions: list[int]):
    """Prefill `ids` in chunks of `chunk` rows (1: token by token through the decode width)
    -> logits at `positions` [len(positions), vocab]."""
    seq = runner.allocate()
    out = {}
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        logits = runner.forward([seq], [part], all_logits=True)
        for r, p in enumerate(range(start, start + len(part))):
            if p in positions:
                out[p] = logits[r]
    runner.free(seq)
    return torch.stack([out[p] for p in positions])


def decode_logits(runner: Runner, prompt: list[int], steps: list[int]) -> torch.Tensor:
    """Prefill `prompt`, then decode `steps` one token at a time -> their logits."""
    seq = runner.allocate()
    runner.forward([seq], [prompt])
    out = torch.cat([runner.forward([seq], [[t]]) for t in steps])
    runner.free(seq)
    return out


def greedy(runner: Runner, prompt: list[int], steps: int) -> list[int]:
    seq = runner.allocate()
    logits = runner.forward([seq], [prompt])
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.forward([seq], [[tokens[-1]]])
    runner.free(seq)
    return tokens


def correctness_1b(gen: torch.Generator) -> dict:
    """gemma3-1b random weights: GPU vs float64 CPU reference (transformers, float64 norms),
    chunkings against each other, graph replay vs eager, greedy tokens vs the CPU backend."""
    cfg = preset("gemma3-1b")
    w_cpu = random_weights(cfg, BF16, "cpu", seed=0)
    weights = _to_device(w_cpu, DEV)
    window = cfg.sliding_window
    positions = [1, 31, 32, 33, window - 1, window, window + 1, 2 * window - 1, 2 * window,
                 2 * window + 1]
    ids = torch.randint(0, cfg.vocab_size, (2 * window + 2,), generator=gen).tolist()
    runner, _ = make_runner(cfg, weights, 4096)
    res: dict = {"positions": positions}
    one = prefill_logits(runner, ids, len(ids), positions)
    c64 = prefill_logits(runner, ids, 64, positions)
    tok = prefill_logits(runner, ids, 1, positions)
    say("correctness gemma3-1b: float64 CPU reference ...")
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    hf = hf_twin(cfg, w_cpu, "cpu", torch.float64, attn="eager")
    with torch.no_grad():
        want = hf(torch.tensor([ids]), logits_to_keep=torch.tensor(positions)).logits[0]
    del hf
    say(f"  reference forward {time.perf_counter() - t0:.1f} s")
    per_pos = []
    for j, p in enumerate(positions):
        row = {"position": p}
        for name, got in (("one_chunk", one), ("chunks64", c64), ("token_by_token", tok)):
            g = got[j].double().cpu()
            row[name] = {"rel_err": ((g - want[j]).norm() / want[j].norm()).item(),
                         "max_abs": (g - want[j]).abs().max().item(),
                         "top1_match": bool(g.argmax() == want[j].argmax())}
        per_pos.append(row)
    res["vs_float64"] = per_pos
    res["ref_logit_std"] = want.std().item()
    worst = max(r[n]["rel_err"] for r in per_pos for n in ("one_chunk", "chunks64",
                                                          "token_by_token"))
    res["vs_float64_worst_rel_err"] = worst
    res["tolerance_rel_err"] = 2e-2
    res["top1_all_match"] = all(r[n]["top1_match"] for r in per_pos for n in (
        "one_chunk", "chunks64", "token_by_token"))
    say(f"  GPU vs float64 at {positions}: worst rel L2 err {worst:.2e} (tol 2e-2), "
        f"top-1 all equal: {res['top1_all_match']}")
    for a_name, a, b_name, b in (("one_chunk", one, "chunks64", c64),
                                 ("one_chunk", one, "token_by_token", tok),
                                 ("chunks64", c64, "token_by_token", tok)):
        key = f"{a_name}_vs_{b_name}"
        res[key] = {"bitwise": bool(torch.equal(a, b)), "max_abs": (a - b).abs().max().item()}
        say(f"  {key}: bitwise {res[key]['bitwise']}, max |diff| {res[key]['max_abs']:.3g}")
    # CUDA-graph replay vs eager decode.
    eager, _ = make_runner(cfg, weights, 4096, eager=True)
    prompt = ids[:40]
    la = [decode_logits(r, prompt, ids[40:48]) for r in (runner, eager)]
    res["graph_vs_eager"] = {"bitwise": bool(torch.equal(la[0], la[1])),
                             "max_abs": (la[0] - la[1]).abs().max().item()}
    say(f"  graph replay vs eager decode (8 steps): {res['graph_vs_eager']}")
    del eager
    # Greedy: 64 tokens on the GPU vs the CPU backend (its C kernels over the same bf16 values).
    prompt = ids[:16]
    gpu_tokens = greedy(runner, prompt, 64)
    t0 = time.perf_counter()
    cpu_runner = Runner(cfg, EngineConfig.for_device(device="cpu", max_num_seqs=1,
                                                     max_model_len=256), w_cpu)
    cpu_tokens = greedy(cpu_runner, prompt, 64)
    same = sum(a == b for a, b in zip(gpu_tokens, cpu_tokens))
    first_diff = next((i for i, (a, b) in enumerate(zip(gpu_tokens, cpu_tokens)) if a != b), None)
    res["greedy"] = {"steps": 64, "identical": gpu_tokens == cpu_tokens, "equal_count": same,
                     "first_divergence": first_diff, "gpu": gpu_tokens, "cpu": cpu_tokens}
    say(f"  greedy 64 steps GPU vs CPU backend: identical {gpu_tokens == cpu_tokens} "
        f"(first divergence {first_diff}; CPU took {time.perf_counter() - t0:.0f} s)")
    return res


def _to_device(w, device):
    from muser.graph.weights import LayerWeights, ModelWeights

    layers = [LayerWeights(**{f: getattr(lw, f).to(device) for f in LayerWeights.__slots__})
              for lw in w.layers]
    return ModelWeights(w.embed.to(device), w.final_norm.to(device), layers)


# ---------------------------------------------------------------- benchmarks
def matrix_params(cfg) -> int:
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i)


def decode_bytes(cfg, weights, context: int) -> int:
    """Bytes one decode step must read: every weight once (LM head included) + the KV rows."""
    row = cfg.num_kv_heads * cfg.head_dim * 2 * 2  # k and v, bf16
    kv = sum(min(context, cfg.sliding_window) if k == "sliding" else context
             for k in cfg.layer_kinds) * row
    return weights.nbytes() + kv


def prefill_flops(cfg, t: int) -> float:
    """Matrix FLOPs (LM head on the last row only) + attention FLOPs over visible pairs."""
    pairs = {"global": t * (t + 1) / 2,
             "sliding": sum(min(p + 1, cfg.sliding_window) for p in range(t))}
    attn = sum(4 * cfg.num_heads * cfg.head_dim * pairs[k] for k in cfg.layer_kinds)
    return 2 * t * matrix_params(cfg) + 2 * cfg.vocab_size * cfg.hidden_size + attn


def bench_muser(cfg, weights, ids: list[int], lengths, decode_steps: int,
                profile_prefill: bool = False, launch_ab: bool = False) -> tuple[dict, Runner]:
    runner, startup = make_runner(cfg, weights, max(lengths) + decode_steps + 64)
    say(f"  muser startup {startup:.1f} s (graph capture {runner.graphs.capture_s:.1f} s)")
    # With launch_ab, each prefill rep also runs through Triton's own launch path, interleaved.
    times = prefill_times(runner, ids, lengths, (True, False) if launch_ab else (True,))
    out = {"startup_s": startup, "graph_capture_s": runner.graphs.capture_s,
           "prefill_s": times[True], "prefill_samples_ms": times["samples_ms"],
           "prefill_host_return_ms": times["host_return_ms"]}
    if launch_ab:
        out["prefill_s_jit_launch"] = times[False]
    if profile_prefill:
        out["prefill_host_profile"] = host_profile(runner, ids[:512])
    out |= decode_step(runner, ids, decode_steps)
    if launch_ab:
        out["pdl_ab"] = pdl_ab(cfg, weights, ids, decode_steps)
    from muser.ops.triton.linear import choices

    out["projection_paths"] = choices()
    return out, runner


def prefill_times(runner: Runner, ids: list[int], lengths,
                  direct: tuple[bool, ...] = (True,)) -> dict:
    """Median seconds of a fresh sequence's one-chunk prefill of each length, per launch path
    (True: direct launches, False: Triton's JIT entry point), the paths interleaved rep by rep;
    "samples_ms" and "host_return_ms" (when forward() returned) of the direct path."""
    out = {d: {} for d in direct}
    for t in lengths:
        times = {d: [] for d in direct}
        host = []  # direct path: when forward() returned (host work done)
        for _ in range(PREFILL_REPS + 1):
            for d in direct:
                with switches.switched(direct=d):
                    seq = runner.allocate()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    runner.forward([seq], [ids[:t]])
                    if d:
                        host.append(time.perf_counter() - t0)
                    torch.cuda.synchronize()
                    times[d].append(time.perf_counter() - t0)
                runner.free(seq)
        for d in direct:
            out[d][t] = statistics.median(times[d][1:])
        out.setdefault("samples_ms", {})[t] = [round(x * 1e3, 3) for x in times[True]]
        out.setdefault("host_return_ms", {})[t] = round(statistics.median(host[1:]) * 1e3, 3)
        say(f"  muser prefill {t}: {out[True][t] * 1e3:.1f} ms ({t / out[True][t]:.0f} tok/s, "
            f"host done after {out['host_return_ms'][t]:.1f} ms)"
            + (f"; through triton's JIT launch path {out[False][t] * 1e3:.1f} ms"
               if False in out else ""))
    return out


def side_by_side(runner: Runner, calls: dict, ids: list[int], lengths) -> tuple[dict, dict]:
    """Median seconds of muser's prefill and of transformers' compiled forward (`calls`) for
    each length, timed in turn rep by rep and length by length, so a slow spell of the host
    (the pool's hosts differ and drift, and both sides are host-bound at small shapes) falls
    on both alike."""
    ours = {t: [] for t in lengths}
    theirs = {t: [] for t in lengths}
    for _ in range(PREFILL_REPS + 1):
        for t in lengths:
            seq = runner.allocate()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.forward([seq], [ids[:t]])
            torch.cuda.synchronize()
            ours[t].append(time.perf_counter() - t0)
            runner.free(seq)
            t0 = time.perf_counter()
            calls[t]()
            torch.cuda.synchronize()
            theirs[t].append(time.perf_counter() - t0)
    ours = {t: statistics.median(v[1:]) for t, v in ours.items()}
    theirs = {t: statistics.median(v[1:]) for t, v in theirs.items()}
    for t in lengths:
        say(f"  side by side, prefill {t}: muser {ours[t] * 1e3:.2f} ms, transformers compiled "
            f"{theirs[t] * 1e3:.2f} ms ({theirs[t] / ours[t]:.2f}x)")
    return ours, theirs


def kernel_profiles(runner: Runner, ids: list[int], prefill: bool) -> dict:
    """GPU time per kernel of one decode step and (optionally) one 512-token prefill. Runs
    after every timing of the process: once attached, CUPTI slows each later launch."""
    say("  decode step kernels:")
    out = {"decode_kernel_us": _profile(runner.graphs.graphs[1].replay)}
    if prefill:
        for t in (512, 2048):
            seq = runner.allocate()
            say(f"  prefill {t} kernels:")
            key = "prefill_kernel_us" if t == 512 else f"prefill_{t}_kernel_us"
            out[key] = _profile(partial(runner.forward, [seq], [ids[:t]]))
            runner.free(seq)
    return out


def decode_step(runner: Runner, ids: list[int], steps: int) -> dict:
    """Greedy decode after a 2,048-token prompt: median seconds per runner step (host packing,
    graph replay, logits, argmax) and per bare graph replay."""
    seq = runner.allocate()
    logits = runner.forward([seq], [ids[:2048]])
    token = int(logits[-1].argmax())
    times = []
    for step in range(steps + 8):
        t0 = time.perf_counter()
        token = int(runner.forward([seq], [[token]])[-1].argmax())
        if step >= 8:
            times.append(time.perf_counter() - t0)
    out = {"decode_s": statistics.median(times),
           "decode_replay_s": bench_ms(runner.graphs.graphs[1].replay, reps=30) / 1e3}
    runner.free(seq)
    say(f"  muser decode after 2048: {out['decode_s'] * 1e3:.3f} ms/token step "
        f"(graph replay alone {out['decode_replay_s'] * 1e3:.3f} ms)")
    return out


def pdl_ab(cfg, weights, ids: list[int], steps: int) -> dict:
    """The decode step with programmatic dependent launch off (the benchmark cells run with it
    on), in the same run and with the same GEMV configs."""
    with switches.switched(pdl=False):
        say("  programmatic dependent launch off:")
        runner, startup = make_runner(cfg, weights, 2048 + steps + 64)
        out = {"off": decode_step(runner, ids, steps) | {"startup_s": startup}}
        del runner
        torch.cuda.empty_cache()
    return out


def host_profile(runner: Runner, ids: list[int]) -> dict:
    """Where the host time of one prefill forward goes (cProfile, top functions by own time);
    the forward is host-bound at gemma3-1b's 512 tokens."""
    import cProfile
    import pstats

    seq = runner.allocate()
    runner.forward([seq], [ids])
    runner.free(seq)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    seq = runner.allocate()
    t0 = time.perf_counter()
    prof.enable()
    runner.forward([seq], [ids])
    prof.disable()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    runner.free(seq)
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append({"fn": f"{Path(file).name}:{line}:{fn}", "calls": nc,
                     "own_ms": tt * 1e3, "cum_ms": ct * 1e3})
    own = sorted(rows, key=lambda r: -r["own_ms"])[:40]
    cum = sorted(rows, key=lambda r: -r["cum_ms"])[:40]
    say(f"  prefill {len(ids)} host profile: forward() returned after {host_s * 1e3:.1f} ms "
        "(under cProfile); top own time:")
    for r in own[:25]:
        say(f"    {r['own_ms']:8.2f} ms  x{r['calls']:<5} {r['fn']}")
    return {"host_ms_under_profile": host_s * 1e3, "by_own_time": own, "by_cum_time": cum,
            "host_us_per_call": host_costs()}


def host_costs(calls: int = 2000) -> dict:
    """Host microseconds per call of the torch entry points and Triton ops a prefill forward
    makes most often (no profiler attached; the GPU work queues behind)."""
    x = torch.randn(512, 1152, device=DEV).to(BF16)
    w = torch.randn(1536, 1152, device=DEV).to(BF16)
    wt = w.t()
    r, n = torch.randn(512, 1152, device=DEV), torch.ones(1152, device=DEV)
    ops = {
        "torch.empty": lambda: torch.empty((512, 1152), dtype=BF16, device=x.device),
        "torch.mm(x, w.t())": lambda: torch.mm(x, w.t()),
        "torch.mm(x, wt)": lambda: torch.mm(x, wt),
        "F.linear(x, w)": lambda: torch.nn.functional.linear(x, w),
        "x.device": lambda: x.device,
        "geglu op (Triton, 5 args)": lambda: tops.geglu(x),
        "add_rms_norm op (Triton, 10 args)": lambda: tops.add_rms_norm(r, x, n, n, 1e-6, BF16),
        "prefill GEMM op (Triton, 16 args)": lambda: gemm(x, w, GEMM_CANDIDATES[1]),
    }
    out = {}
    for name, fn in ops.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = round((time.perf_counter() - t0) / calls * 1e6, 2)
        torch.cuda.synchronize()
    say(f"  host us per call: {out}")
    return out


def _profile(fn) -> dict:
    """GPU microseconds per kernel name in one call of fn (CUPTI traces graph kernels too)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows = {}
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if us:
                rows[e.key[:60]] = (round(us, 1), e.count)
        top = dict(sorted(rows.items(), key=lambda kv: -kv[1][0])[:14])
        total = sum(v[0] for v in rows.values())
        say(f"  {sum(v[1] for v in rows.values())} launches, {total:.0f} us of kernel time "
            "(with programmatic dependent launch a kernel's time includes its wait)")
        for k, (us, count) in top.items():
            say(f"    {us:9.1f} us  x{count:<4} {k}")
        return {"total_us": total, "top": top}
    except Exception as exc:  # noqa: BLE001
        say(f"  profile failed: {exc}")
        return {}


@torch.no_grad()
def bench_hf(cfg, weights, ids: list[int], lengths, decode_steps: int) -> dict:
    model = hf_twin(cfg, weights, DEV, BF16, attn="sdpa")
    out: dict = {"prefill_s": {}}
    for t in lengths:
        x = torch.tensor([ids[:t]], device=DEV)
        times = []
        for rep in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x, logits_to_keep=1, use_cache=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out["prefill_s"][t] = statistics.median(times[1:])
        say(f"  transformers eager prefill {t}: {out['prefill_s'][t] * 1e3:.1f} ms")
    x = torch.tensor([ids[:2048]], device=DEV)
    res = model(x, use_cache=True, logits_to_keep=1)
    cache, token = res.past_key_values, res.logits[:, -1:].argmax(-1)
    times = []
    for step in range(decode_steps // 2 + 4):
        t0 = time.perf_counter()
        res = model(token, past_key_values=cache, use_cache=True)
        token = res.logits[:, -1:].argmax(-1)
        token.item()
        if step >= 4:
            times.append(time.perf_counter() - t0)
    out["decode_eager_s"] = statistics.median(times)
    say(f"  transformers eager decode: {out['decode_eager_s'] * 1e3:.2f} ms/token")
    del cache, res
    del model
    torch.cuda.empty_cache()
    return out


REUSED_NOTE = ("reused, not measured in this run: the issue's figure for transformers static "
               "cache + torch.compile on this H200 (allowed to be measured once and reused)")
BARS = {("gemma3-27b", "decode"): ("fraction_of_ceiling", 0.80),
        ("gemma3-27b", "prefill", 2048): ("fraction_of_ceiling", 0.60),
        ("gemma3-1b", "decode"): ("fraction_of_ceiling", 0.40),
        ("gemma3-1b", "prefill", 2048): ("value", 80000.0)}


def cells_for(name, cfg, weights, ceil, ours, hf, lengths) -> list[dict]:
    cells = []
    shape = {"layers": cfg.num_layers, "hidden": cfg.hidden_size,
             "intermediate": cfg.intermediate_size, "heads": cfg.num_heads,
             "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
             "window": cfg.sliding_window, "vocab": cfg.vocab_size}
    floor_bytes = decode_bytes(cfg, weights, 2048 + 32)
    floor_s = floor_bytes / ceil["copy_bytes_per_s"]
    hf_best = hf.get("decode_static_compile_s")
    cell = {"name": f"{name} decode b1 @2048", "model": name, "regime": "decode",
            "value": ours["decode_s"] * 1e3, "unit": "ms/token",
            "graph_replay_ms": ours["decode_replay_s"] * 1e3,
            "bytes_per_token": floor_bytes, "floor_ms": floor_s * 1e3,
            "fraction_of_ceiling": floor_s / ours["decode_s"],
            "ceiling": "device-to-device copy bandwidth",
            "transformers_eager_ms": hf.get("decode_eager_s", float("nan")) * 1e3,
            "transformers_static_compile_ms": hf_best * 1e3 if hf_best else None,
            "vs_transformers": (hf_best or hf["decode_eager_s"]) / ours["decode_s"],
            "vs_transformers_baseline": "static cache + torch.compile" if hf_best else
            "eager (static+compile not measured)",
            "vs_transformers_eager": hf["decode_eager_s"] / ours["decode_s"],
            "transformers_static_compile_source": hf.get("decode_static_compile_source"),
            "transformers_static_compile_own_attempt_ms": hf.get("decode_own_attempt_ms"),
            "dtype": "bfloat16", "batch": 1, "context": 2048, "shape": shape}
    if "pdl_ab" in ours:  # the same step with programmatic dependent launch off
        cell["pdl_ab_ms"] = {"on": ours["decode_s"] * 1e3} | {
            k: v["decode_s"] * 1e3 for k, v in ours["pdl_ab"].items()}
        cell["pdl_ab_replay_ms"] = {"on": ours["decode_replay_s"] * 1e3} | {
            k: v["decode_replay_s"] * 1e3 for k, v in ours["pdl_ab"].items()}
        say(f"  decode step ms by launch mode: {cell['pdl_ab_ms']}")
    cells.append(cell)
    for t in lengths:
        s = ours["prefill_s"][t]
        flops = prefill_flops(cfg, t)
        hf_s = hf["prefill_s"][t]
        compiled_s = hf.get("compiled_prefill_s", {}).get(t)
        cells.append({
            "name": f"{name} prefill {t}", "model": name, "regime": "prefill", "tokens": t,
            "value": t / s, "unit": "tokens/s", "ms": s * 1e3, "flops": flops,
            "fraction_of_ceiling": flops / s / ceil["gemm_bf16_flops_per_s"],
            "ceiling": "bf16 GEMM FLOP/s at 8192^3",
            "transformers_eager_tokens_per_s": t / hf_s,
            "transformers_compiled_tokens_per_s": t / compiled_s if compiled_s else None,
            "vs_transformers": (compiled_s or hf_s) / s,
            "vs_transformers_baseline": "torch.compile" if compiled_s else "eager (sdpa)",
            "vs_transformers_eager": hf_s / s,
            "transformers_compiled_source": hf.get("compiled_prefill_source"),
            "ms_through_triton_jit_launch": ours.get("prefill_s_jit_launch", {}).get(t, 0) * 1e3
            or None,
            "dtype": "bfloat16", "batch": 1, "shape": shape,
        })
    for c in cells:
        key = (name, c["regime"]) if c["regime"] == "decode" else (name, "prefill", c["tokens"])
        if key in BARS:
            field, bar = BARS[key]
            c["bar"] = {"field": field, "min": bar, "met": bool(c[field] >= bar)}
        say(f"  CELL {c['name']:<30} {c['value']:>12.3f} {c['unit']:<9} "
            f"fraction {c['fraction_of_ceiling']:.3f}  vs transformers x{c['vs_transformers']:.2f}"
            + (f"  bar {'MET' if c['bar']['met'] else 'MISSED'}" if "bar" in c else ""))
    return cells


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = [c["name"] for c in cells]
    fr = [c["fraction_of_ceiling"] for c in cells]
    colors = ["tab:blue" if c["regime"] == "decode" else "tab:orange" for c in cells]
    ax.bar(range(len(cells)), fr, color=colors)
    for j, c in enumerate(cells):
        ax.text(j, fr[j] + 0.01, f"{fr[j]:.2f}\nx{c['vs_transformers']:.1f} HF", ha="center",
                fontsize=7)
        if "bar" in c and c["bar"]["field"] == "fraction_of_ceiling":
            ax.hlines(c["bar"]["min"], j - 0.4, j + 0.4, colors="red", linestyles="dashed")
    ax.set_xticks(range(len(cells)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("fraction of measured ceiling")
    ax.set_ylim(0, 1.1)
    ax.set_title("muser on H200, bf16: decode vs copy bandwidth (blue), prefill vs GEMM (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def environment() -> dict:
    import transformers
    import triton

    p = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "sms": p.multi_processor_count,
            "memory_GiB": p.total_memory / 2**30, "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "dtype": "bfloat16",
            "kv_dtype": "bfloat16"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--models", default="gemma3-1b,gemma3-27b")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--check-models", default="",
                    help="models whose kernels are checked (default: every benchmarked model)")
    ap.add_argument("--skip-sweeps", action="store_true",
                    help="with the kernel checks, skip the GEMV bandwidth and attention sweeps")
    ap.add_argument("--pdl-ab", default="gemma3-1b",
                    help="models whose decode step is also measured with programmatic "
                    "dependent launch off, and prefill through Triton's JIT launch path")
    ap.add_argument("--measure-compiled", default="",
                    help="models whose transformers compiled prefill is measured in this run "
                    "even when --hf-compiled holds a figure")
    ap.add_argument("--profile-prefill", default="gemma3-1b",
                    help="models whose 512-token prefill forward is profiled on the host")
    ap.add_argument("--hf-static-compile-ms", default="gemma3-1b=4.21,gemma3-27b=24.45",
                    help="transformers static cache + torch.compile decode ms/token, measured "
                    "once on this H200 and reused (the issue's figures); '' to omit")
    ap.add_argument("--hf-compiled", default="bench/results/hf_compiled.json",
                    help="transformers compiled prefill (and our own static+compile decode "
                    "attempt) from bench/gpu_probe.py; models missing there are measured")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    result: dict = {"environment": environment()}
    say(json.dumps(result["environment"]))
    result["ceilings"] = ceil = ceilings()
    lengths = [int(t) for t in args.lengths.split(",")]
    reused = {k: float(v) for k, v in (
        kv.split("=") for kv in args.hf_static_compile_ms.split(",") if kv)}
    models = args.models.split(",")
    path = Path(args.hf_compiled)
    compiled = json.loads(path.read_text()) if path.exists() else {}
    save = lambda: (out_dir / "gpu_bench.json").write_text(
        json.dumps(result | {"log": LOG}, indent=1, default=str))
    if not args.skip_checks:
        result["kernel_checks"], result["gemv_bandwidth"] = {}, {}
        for name in args.check_models.split(",") if args.check_models else models:
            say(f"kernel checks, {name} shapes:")
            cfg = preset(name)
            result["kernel_checks"][name] = check_kernels(cfg, gen)
            if not args.skip_sweeps:
                result["gemv_bandwidth"][name] = gemv_bandwidth(cfg)
                result.setdefault("attention_sweep", {})[name] = attention_sweep(cfg)
        save()
    if not args.skip_correctness:
        result["correctness_gemma3_1b"] = correctness_1b(torch.Generator().manual_seed(0))
        save()
    result["cells"] = []
    runners = []
    for name in models:
        say(f"benchmark {name}:")
        cfg = preset(name)
        weights = random_weights(cfg, BF16, DEV, seed=0)
        ids = torch.randint(0, cfg.vocab_size, (max(lengths),),
                            generator=torch.Generator().manual_seed(1)).tolist()
        hf = bench_hf(cfg, weights, ids, lengths, args.decode_steps)
        ours, runner = bench_muser(cfg, weights, ids, lengths, args.decode_steps,
                                   name in args.profile_prefill.split(","),
                                   name in args.pdl_ab.split(","))
        if name in reused:
            hf["decode_static_compile_s"] = reused[name] / 1e3
            hf["decode_static_compile_source"] = REUSED_NOTE
        earlier = compiled.setdefault("models", {}).setdefault(name, {})
        if "decode" in earlier:
            hf["decode_own_attempt_ms"] = earlier["decode"]["decode_s"] * 1e3
        if "prefill_s" not in earlier or name in args.measure_compiled.split(","):
            model = hf_twin(cfg, weights, DEV, BF16, attn="sdpa")
            calls = compiled_prefill_calls(model, ids, lengths, say)
            ours["prefill_s_timed_alone"] = ours["prefill_s"]
            ours["prefill_s"], earlier["prefill_s"] = side_by_side(runner, calls, ids, lengths)
            earlier["prefill_date"] = time.strftime("%Y-%m-%d")
            del model, calls
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            (out_dir / "hf_compiled.json").write_text(json.dumps(compiled, indent=1))
            hf["compiled_prefill_source"] = (
                "measured in this run, timed in turn with muser's prefill rep by rep")
        else:
            hf["compiled_prefill_source"] = (
                f"reused from {args.hf_compiled} (measured in an earlier run on this H200 kind, "
                f"{earlier.get('prefill_date', 'date not recorded')})")
        hf["compiled_prefill_s"] = {int(t): v for t, v in earlier["prefill_s"].items()}
        runners.append((name, runner, ids))
        result.setdefault("raw", {})[name] = {"muser": ours, "transformers": hf}
        result["cells"] += cells_for(name, cfg, weights, ceil, ours, hf, lengths)
        del weights
        save()
    for name, runner, ids in runners:  # NOTE: after every timing (see kernel_profiles)
        say(f"kernel profiles {name}:")
        result["raw"][name]["muser"] |= kernel_profiles(
            runner, ids, name in args.profile_prefill.split(","))
    save()
    plot(result["cells"], out_dir / "gpu_bench.png")
    save()
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
