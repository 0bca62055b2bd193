"""Projections and the embedding lookup over matrices kept as GGUF blocks (one type, or row
segments of several), through the Triton backend's ops: the decode block GEMVs (on the exact
route the dot kind, up to 64 rows; off it the int8 kind, up to 8) and the dequantized
workspace (more rows, and the LM head in row tiles of it)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from test_blocks import _random_blocks, x_hat
from test_layer_graph import GRAPH_ATOL, GRAPH_RTOL

import muser.ops.triton as triton_ops
from muser.config import EngineConfig
from muser.loading.gguf import config_from_gguf, load_weights, open_gguf
from muser.ops import ref
from muser.ops.blocks import BlockMatrix, BlockRows, cat_blocks, segments
from muser.ops.triton import (
    add_rms_norm,
    block_weights,
    embed,
    geglu,
    linear,
    linear_add_rms_norm,
    linear_geglu,
)
from muser.ops.triton.dequantize_blocks import dequantize_blocks
from muser.ops.triton.gemv_blocks import MAX_ROWS
from muser.ops.triton.switches import switched
from muser.runner import Runner
from tests.error_bounds import gamma
from tests.tiny_gguf import tiny_gguf

from opcheck import DEVICE, UNIT_ROUNDOFF, rand

QT = GGMLQuantizationType
K = 512  # two 256-value super-blocks, sixteen 32-value blocks


def _blocks(gen, dtype, *parts: tuple[QT, int]):
    """A [sum rows, K] matrix of random blocks in the given (type, rows) segments, as the
    loader fuses them (cat_blocks)."""
    mats = [BlockMatrix.from_raw(torch.from_numpy(_random_blocks(gen, q, rows, K)).to(DEVICE),
                                 q, (rows, K), dtype) for q, rows in parts]
    return cat_blocks(mats)


def _values(w) -> torch.Tensor:
    """The exact float32 values of every row (gguf's dequantization)."""
    return torch.cat([part.dequantize() for _, part in segments(w)])


def _dense(w, dtype: torch.dtype) -> torch.Tensor:
    """The matrix as the workspace holds it: each segment dequantized by the kernel."""
    return torch.cat([dequantize_blocks(part, dtype) for _, part in segments(w)])


MIXED = ((QT.Q5_0, 16), (QT.Q8_0, 8), (QT.Q4_K, 13), (QT.Q6_K, 8))  # like a Q4_K_M QKV
SINGLE = ((QT.Q4_K, 37),)
OTHERS = ((QT.Q5_K, 21), (QT.Q4_0, 11))  # the types of files other than Q4_K_M (Q5_K_M, Q4_0)


def _bound(x: torch.Tensor, w, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(exact x W^T in float64, its error bound). The weights are exact float32 values (the
    block readers and the dequantization are gguf's, bit for bit; a float32 workspace holds
    them exactly), so the roundings are the K float32 products and the K-term sum, in any
    order: gamma_K * sum |x w| (plus the float64 reference's own K 2^-53 of it), then one
    rounding of the output to `dtype`: u * |y|. Decode rows (<= 8) multiply x^, int8_rows'
    values (test_blocks.py): sum |x - x^| |w| more, and the sums run over
    |x^| <= |x| + |x - x^|."""
    wd = _values(w).double()
    exact = x.double() @ wd.t()
    mags = x.double().abs() @ wd.abs().t()
    quant = torch.zeros_like(mags)
    if x.shape[0] <= MAX_ROWS:
        err = (x_hat(x.float().cpu()) - x.double().cpu()).abs().to(wd.device)
        quant = err @ wd.abs().t()
    u = UNIT_ROUNDOFF[dtype]
    g = gamma(K) + K * 2.0**-53
    return exact, (g * (mags + quant) + quant) * (1 + u) + u * exact.abs()


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "int8"])
@pytest.mark.parametrize("parts", [SINGLE, MIXED, OTHERS], ids=["single", "mixed", "others"])
@pytest.mark.parametrize("n,dtype", [(1, torch.float32), (3, torch.float16), (8, torch.float32),
                                     (17, torch.float32)])
def test_linear_over_blocks(gen, parts, n, dtype, exact):
    """Decode rows (a block GEMV per segment, into one output: the dot kind on the exact route,
    up to 64 rows; the int8 kind off it, up to 8) and a prefill chunk (the matrix dequantized
    into the workspace, then the dense projection) within the error bound."""
    w = _blocks(gen, dtype, *parts)
    assert isinstance(w, BlockRows if len(parts) > 1 else BlockMatrix)
    x = rand(gen, n, K, dtype=dtype)
    with switched(exact=exact, exact_blocks=exact):
        y = linear(x, w)
    exact, bound = _bound(x, w, dtype)
    assert y.shape == (n, w.shape[0]) and y.dtype == dtype
    assert ((y.double().cpu() - exact.cpu()).abs() <= bound.cpu()).all()


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "int8"])
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "single"])
@pytest.mark.parametrize("n", [2, 17])
def test_epilogues_follow_the_projection(gen, n, mixed, exact):
    """GeGLU and the residual add + RMSNorm after a block projection: decode rows run GeGLU in
    the block GEMV's epilogue (one block type; off the exact route the norm pair too) or as
    their own kernels after it (row segments of several), the result in both those ops on
    linear()'s output, bit for bit; a prefill chunk (off the exact route: 17 rows) runs the
    dense projection on the dequantized matrix, so the result is the dense route's on it, bit
    for bit; on the exact route 17 rows are decode rows and give the dense route's bits too."""
    with switched(exact=exact, exact_blocks=exact):
        _epilogues(gen, n, mixed)


def _epilogues(gen, n: int, mixed: bool) -> None:
    dtype = torch.float32
    if mixed:
        gate_up = _blocks(gen, dtype, (QT.Q4_K, 24), (QT.Q6_K, 24))  # gate Q4_K, up Q6_K
        down = _blocks(gen, dtype, *MIXED)
    else:
        gate_up, down = _blocks(gen, dtype, (QT.Q4_K, 48)), _blocks(gen, dtype, (QT.Q6_K, 40))
    x = rand(gen, n, K, scale=1e-3)  # GeGLU's exp in range
    m = down.shape[0]
    res, post, nxt = rand(gen, n, m), rand(gen, m), rand(gen, m)
    got_geglu = linear_geglu(x, gate_up)
    got_norm = linear_add_rms_norm(x, down, res, post, nxt, 1e-6, dtype)
    if n <= 8:
        want_geglu = geglu(linear(x, gate_up))
        want_norm = add_rms_norm(res, linear(x, down), post, nxt, 1e-6, dtype)
    else:
        want_geglu = linear_geglu(x, _dense(gate_up, dtype))
        want_norm = linear_add_rms_norm(x, _dense(down, dtype), res, post, nxt, 1e-6, dtype)
    assert torch.equal(got_geglu, want_geglu)
    assert torch.equal(got_norm[0], want_norm[0]) and torch.equal(got_norm[1], want_norm[1])


def test_head_in_workspace_tiles(gen, monkeypatch):
    """A matrix wider than the workspace (the LM head) is projected in row tiles of it: the
    output is within the bound and the workspace is not grown."""
    monkeypatch.setattr(block_weights, "_WORKSPACE", {})
    monkeypatch.setattr(block_weights, "HEAD_TILE_ROWS", 16)
    dtype = torch.float32
    w = _blocks(gen, dtype, *MIXED)  # 45 rows
    workspace = block_weights.reserve(torch.device(DEVICE), dtype, 16 * K)  # tiles of 16 rows
    x = rand(gen, 11, K)
    y = linear(x, w)
    exact, bound = _bound(x, w, dtype)
    assert ((y.double().cpu() - exact.cpu()).abs() <= bound.cpu()).all()
    assert block_weights._WORKSPACE[(torch.device(DEVICE), dtype)] is workspace
    assert workspace.numel() == 16 * K


def test_embed_dequantizes_the_rows_asked_for(gen):
    """The rows asked for; with a scale, each value times it (rounded once); with a feed, the
    rows whose id is negative read the feed's."""
    w = _blocks(gen, torch.float32, (QT.Q6_K, 40))
    ids = torch.tensor([3, 0, 39, 3], device=DEVICE)
    values = _values(w).cpu()
    assert torch.equal(embed(w, ids).cpu(), values[ids.cpu()])
    feed = torch.tensor([7, 8, 9, 10], device=DEVICE)
    got = embed(w, torch.tensor([3, -1, 39, -1], device=DEVICE), 25.3, feed).cpu()
    want = (values[[3, 8, 39, 10]].double() * torch.tensor(25.3).float().double()).float()
    assert torch.equal(got, want)


def _logits(path, blocks: bool, ops) -> torch.Tensor:
    """Logits of a prefill chunk of 12 rows (workspace route), one of 3 (block GEMV) and a
    decode step, of the GGUF at `path` in float32 on `ops`."""
    reader = open_gguf(path)
    cfg = config_from_gguf(reader)
    engine = EngineConfig.for_device(device=DEVICE, dtype="float32", kv_dtype="float32",
                                     max_num_seqs=1, max_model_len=32, page_size=16,
                                     enforce_eager=True)
    weights = load_weights(reader, cfg, torch.float32, DEVICE, blocks=blocks)
    runner = Runner(cfg, engine, weights)
    runner.model.ops, runner.model.weights = ops, ops.prepare_weights(weights)
    ids = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(0))
    seq = runner.allocate()
    out = [runner.forward([seq], [ids[:12].tolist()], all_logits=True),
           runner.forward([seq], [ids[12:15].tolist()], all_logits=True),
           runner.forward([seq], [[int(ids[15])]])]
    return torch.cat(out).cpu()


# NOTE: synth_gguf's large activations saturate GeGLU's tanh, whose exp overflows to inf (and
# tanh to 1) in the interpreter's numpy
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_model_of_blocks_equals_dense_reference(tmp_path, monkeypatch):
    """A Q4_K_M file of synth_gguf (Q4_K and Q6_K segments in QKV, a Q6_K tied head and
    embedding) kept as blocks through the Triton ops equals the reference ops (torch) on
    its dequantized float32 matrices. The weights' values are the same bit for bit, so the two
    differ only as test_layer_graph's float32 graphs do: its tolerance, with its unit activation
    scale replaced by the largest logit (synth_gguf's random blocks are not unit-gain)."""
    monkeypatch.setenv("MUSER_OPS", "ref")  # the runner's own backend: takes any weights
    monkeypatch.setattr(block_weights, "_WORKSPACE", {})
    path = tiny_gguf(tmp_path, "q4_k_m")
    expect = _logits(path, False, ref)
    got = _logits(path, True, triton_ops)
    (workspace,) = block_weights._WORKSPACE.values()
    assert workspace.numel() == 2 * 512 * 256  # the largest layer matrix: gate_up
    scale = expect.abs().max().item()
    torch.testing.assert_close(got, expect, atol=GRAPH_ATOL * scale, rtol=GRAPH_RTOL)


def test_a_stored_block_pick_is_the_one_that_runs(gen):
    """A block GEMV config taken from the tuning cache (`tuning.load` ->
    block_weights.remember) is the config of its shape, over what this machine would choose
    (the default on the CPU), and is not stored again as if measured here."""
    from muser.ops.triton.gemv_blocks import candidates_blocks, default_config

    w = _blocks(gen, torch.float32, (QT.Q8_0, 24))  # a shape no other test projects
    x = rand(gen, 1, K, dtype=torch.float32)
    key = (1, 24, K, QT.Q8_0, torch.float32)
    stored = next(c for c in candidates_blocks(1, 24, K, QT.Q8_0)
                  if c != default_config(1, 24, K, QT.Q8_0))
    assert block_weights.remember({key: (stored, {"stored": 0.01})}, "cache") == 1
    assert block_weights.gemv_config(x, w, None) == stored  # chosen without running
    with switched(exact=False):  # the int8 kind's route
        y = linear(x, w)
    exact, bound = _bound(x, w, torch.float32)
    assert ((y.double().cpu() - exact.cpu()).abs() <= bound.cpu()).all()
    assert key not in block_weights.measured()
