"""Which tile arithmetic gives the same bits per output element, measured on the GPU (the facts
the exact routes rest on; docs/exactness.md):

- `dot`: y = x @ W^T accumulated over K by one chain of tensor-core dots, in tiles of many
  shapes (tokens x weight rows x K step, warps, operands swapped or not, mma.sync or wgmma),
  for bf16 and e4m3 operands: does one output element's float32 sum depend on the tile?
- `rowsum`: the online softmax of one row over 64-key tiles, its row sum by `tl.sum` or by a
  tensor-core dot with ones, in query tiles of 16, 64 and 128 rows and 4 or 8 warps;
- `norm`: a row's sum of squares by `tl.sum` over one [BLOCK] vector at 4 and 8 warps, and over
  [ROWS, BLOCK] tiles.

- `projections`: muser's exact route (linear, linear_geglu, linear_add_rms_norm) on gemma3-1b
  and gemma3-27b shapes, each row at widths 1 .. 512 against the same row at width 512, exact on
  and off, and each width's time on both routes (graph replay up to 64 rows, eager beyond).

Each check compares every row with the first configuration's: `bitwise_rows` of `rows`.

    PYTHONPATH=. python3 bench/exact_probe.py --out $OUT/exact_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _dot_kernel(x_ptr, w_ptr, y_ptr, N, M, K, BT: tl.constexpr, BW: tl.constexpr,
                BK: tl.constexpr, SWAP: tl.constexpr):
    rw = tl.program_id(0) * BW + tl.arange(0, BW)
    rt = tl.program_id(1) * BT + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    if SWAP:
        acc = tl.zeros((BW, BT), tl.float32)
    else:
        acc = tl.zeros((BT, BW), tl.float32)
    for k0 in range(0, K, BK):
        k_in = (k0 + rk[None, :]) < K
        x = tl.load(x_ptr + rt[:, None] * K + k0 + rk[None, :], mask=(rt[:, None] < N) & k_in,
                    other=0.0)
        w = tl.load(w_ptr + rw[:, None] * K + k0 + rk[None, :], mask=(rw[:, None] < M) & k_in,
                    other=0.0)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP:
        tl.store(y_ptr + rt[None, :] * M + rw[:, None], acc,
                 mask=(rt[None, :] < N) & (rw[:, None] < M))
    else:
        tl.store(y_ptr + rt[:, None] * M + rw[None, :], acc,
                 mask=(rt[:, None] < N) & (rw[None, :] < M))


def dot(x, w, bt, bw, bk, warps, swap, stages):
    n, k = x.shape
    m = w.shape[0]
    y = torch.full((n, m), float("nan"), device=x.device)
    _dot_kernel[(triton.cdiv(m, bw), triton.cdiv(n, bt))](
        x, w, y, n, m, k, BT=bt, BW=bw, BK=bk, SWAP=swap, num_warps=warps, num_stages=stages)
    return y


@triton.jit
def _softmax_kernel(q_ptr, k_ptr, v_ptr, o_ptr, l_ptr, R, S, BQ: tl.constexpr,
                    BKV: tl.constexpr, D: tl.constexpr, ONES: tl.constexpr):
    rq = tl.program_id(0) * BQ + tl.arange(0, BQ)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rq[:, None] * D + d[None, :], mask=rq[:, None] < R, other=0.0)
    m = tl.full((BQ,), float("-inf"), tl.float32)
    l = tl.zeros((BQ,), tl.float32)
    acc = tl.zeros((BQ, D), tl.float32)
    ones = tl.full((BKV, 16), 1.0, q.dtype)
    for k0 in range(0, S, BKV):
        rk = k0 + tl.arange(0, BKV)
        k = tl.load(k_ptr + rk[:, None] * D + d[None, :])
        v = tl.load(v_ptr + rk[:, None] * D + d[None, :])
        s = tl.dot(q, tl.trans(k)) * 0.0625
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        if ONES:
            l = l * alpha + tl.max(tl.dot(p.to(v.dtype), ones), axis=1)
        else:
            l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(o_ptr + rq[:, None] * D + d[None, :], acc, mask=rq[:, None] < R)
    tl.store(l_ptr + rq, l, mask=rq < R)


@triton.jit
def _sumsq_kernel(x_ptr, y_ptr, R, D, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, BLOCK)
    if ROWS == 1:
        x = tl.load(x_ptr + tl.program_id(0) * D + e, mask=e < D, other=0.0)
        tl.store(y_ptr + tl.program_id(0), tl.sum(x * x, axis=0))
    else:
        x = tl.load(x_ptr + r[:, None] * D + e[None, :], mask=(r[:, None] < R) & (e[None, :] < D),
                    other=0.0)
        tl.store(y_ptr + r, tl.sum(x * x, axis=1), mask=r < R)


def compare(outs: dict[str, torch.Tensor]) -> list[dict]:
    names = list(outs)
    base = outs[names[0]]
    cells = []
    for name in names[1:]:
        y = outs[name]
        if y is None:
            cells.append({"config": name, "error": "did not compile"})
            continue
        same = (y.view(torch.int32) == base.view(torch.int32)).reshape(y.shape[0], -1).all(1)
        cells.append({"config": name, "rows": int(y.shape[0]),
                      "bitwise_rows": int(same.sum()),
                      "max_abs": float((y - base).abs().max())})
    return cells


DOT_CONFIGS = [  # tokens, weight rows, K step, warps, swapped, stages
    (16, 64, 64, 4, True, 3), (16, 128, 128, 4, True, 4), (16, 64, 256, 4, True, 4),
    (64, 128, 64, 4, False, 3), (128, 128, 64, 8, False, 3), (32, 64, 64, 4, False, 3),
    (128, 128, 64, 8, True, 3), (64, 256, 64, 8, True, 3), (16, 32, 32, 1, False, 2),
    (16, 16, 16, 1, True, 2), (32, 32, 32, 2, False, 2), (64, 64, 64, 4, False, 1),
]


def probe_dot(dtype, k: int, m: int, n: int = 256) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(k + m)
    x = torch.randn(n, k, device="cuda", generator=g)
    w = torch.randn(m, k, device="cuda", generator=g) * 0.05
    if dtype == torch.float8_e4m3fn:
        x, w = (x * 4).to(dtype), (w * 64).to(dtype)
    else:
        x, w = x.to(dtype), w.to(dtype)
    outs = {}
    for c in DOT_CONFIGS:
        bk = max(c[2], 32) if dtype == torch.float8_e4m3fn else c[2]
        for rows in (n, 1, 5, 64):
            name = f"t{c[0]} w{c[1]} k{bk} warps{c[3]} swap{int(c[4])} st{c[5]} rows{rows}"
            try:
                outs[name] = dot(x[:rows], w, c[0], c[1], bk, c[3], c[4], c[5])
            except Exception as e:  # noqa: BLE001
                print("  ", name, type(e).__name__, str(e)[:120])
                outs[name] = None
    base = outs[next(iter(outs))]
    cells = []
    for name, y in outs.items():
        if y is None:
            cells.append({"config": name, "error": "failed"})
            continue
        b = base[: y.shape[0]]
        same = (y.view(torch.int32) == b.view(torch.int32)).all(1)
        cells.append({"config": name, "rows": int(y.shape[0]), "bitwise_rows": int(same.sum()),
                      "max_abs": float((y - b).abs().max())})
    return cells


def probe_rowsum(d: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(d)
    r, s = 256, 1024
    q = torch.randn(r, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(s, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(s, d, device="cuda", generator=g).bfloat16()
    cells = []
    for ones in (False, True):
        outs = {}
        for bq, warps in ((16, 4), (64, 4), (128, 8), (64, 8), (16, 1), (128, 4)):
            o = torch.empty(r, d, device="cuda")
            l = torch.empty(r, device="cuda")
            try:
                _softmax_kernel[(triton.cdiv(r, bq),)](q, k, v, o, l, r, s, BQ=bq, BKV=64, D=d,
                                                       ONES=ones, num_warps=warps)
                outs[f"q{bq} warps{warps}"] = torch.cat([o, l[:, None]], 1)
            except Exception as e:  # noqa: BLE001
                print("  rowsum", bq, warps, type(e).__name__, str(e)[:120])
                outs[f"q{bq} warps{warps}"] = None
        for c in compare(outs):
            cells.append({"ones": ones, "d": d, **c})
    return cells


def probe_norm(d: int) -> list[dict]:
    x = torch.randn(64, d, device="cuda")
    block = triton.next_power_of_2(d)
    outs = {}
    for rows, warps in ((1, 4), (1, 8), (4, 4), (8, 8), (1, 1)):
        y = torch.empty(64, device="cuda")
        _sumsq_kernel[(triton.cdiv(64, rows),)](x, y, 64, d, ROWS=rows, BLOCK=block,
                                                num_warps=warps)
        outs[f"rows{rows} warps{warps}"] = y[:, None]
    return [{"d": d, **c} for c in compare(outs)]


SHAPES = {  # (M, K, epilogue) of the projections of a layer, and the LM head
    "gemma3-1b": [(1536, 1152, ""), (1152, 1024, "norm"), (13824, 1152, "geglu"),
                  (1152, 6912, "norm"), (262144, 1152, "")],
    "gemma3-27b": [(5376, 4096, "norm"), (43008, 5376, "geglu")],
}
WIDTHS = (1, 8, 16, 64, 512)


def probe_projections(cells: list[dict], save) -> None:
    from muser.ops.triton import linear, linear_add_rms_norm, linear_geglu
    from muser.ops.triton.switches import switched
    from muser.ops.triton.timing import eager_ms, graph_ms

    def project(x, w, epi, norm):
        if epi == "geglu":
            return linear_geglu(x, w)
        if epi == "norm":
            res, post, nxt = norm
            h, y = linear_add_rms_norm(x, w, res[: x.shape[0]], post, nxt, 1e-6, w.dtype)
            return torch.cat([h, y.float()], 1)
        return linear(x, w)

    for model, shapes in SHAPES.items():
        for m, k, epi in shapes:
            g = torch.Generator(device="cuda").manual_seed(m + k)
            w = (torch.randn(m, k, device="cuda", generator=g) * k**-0.5).bfloat16()
            x = torch.randn(512, k, device="cuda", generator=g).bfloat16()
            norm = (torch.randn(512, m, device="cuda", generator=g),
                    torch.rand(m, device="cuda", generator=g) + 0.5,
                    torch.rand(m, device="cuda", generator=g) + 0.5)
            for exact in (True, False):
                with switched(exact=exact):
                    wide = project(x, w, epi, norm)
                    for width in WIDTHS:
                        part = project(x[:width], w, epi, norm)
                        same = (part == wide[:width]).all(1)
                        timer = graph_ms if width <= 64 else eager_ms
                        ms = timer(lambda w_, xs=x[:width], e=epi, nm=norm: project(xs, w_, e, nm),
                                   [w])
                        cells.append({"model": model, "shape": f"{m}x{k}+{epi}",
                                      "exact": exact, "rows": width,
                                      "bitwise_rows": int(same.sum()),
                                      "max_abs": float((part - wide[:width]).abs().max()),
                                      "ms": round(ms, 5)})
                        print(cells[-1])
            del w, x
            torch.cuda.empty_cache()
            save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "dot": {}}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for k, m in ((1152, 1024), (6912, 256)):
            key = f"{str(dtype).split('.')[-1]} K{k} M{m}"
            result["dot"][key] = probe_dot(dtype, k, m)
            bad = [c for c in result["dot"][key] if c.get("bitwise_rows") != c.get("rows")]
            print(key, "configs differing from the first:", len(bad), "of",
                  len(result["dot"][key]))
            for c in bad[:40]:
                print("   ", c)
    result["rowsum"] = probe_rowsum(256) + probe_rowsum(128)
    for c in result["rowsum"]:
        print("rowsum", c)
    result["norm"] = probe_norm(1152) + probe_norm(5376)
    for c in result["norm"]:
        print("norm", c)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    result["projections"] = []

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    probe_projections(result["projections"], save)


if __name__ == "__main__":
    main()
