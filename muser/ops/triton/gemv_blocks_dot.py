"""The exact route's decode GEMV over GGUF blocks (docs/exactness.md): y[N, M] = x[N, K] @ W[M, K]^T
for up to DOT_ROWS rows, W read as the file's bytes, with the bits of the dense route on W
dequantized to the engine's dtype.

Each weight tile is dequantized in registers by block_values.block_tile (the float32 formula
dequantize_blocks.py applies, elementwise, so the same float32 values in any tile; each
sub-block's scales loaded once), rounded to the engine dtype as dequantize_blocks.py stores
it, and fed to gemv.py's `dot` kind's chain:
K cut at the matrix's fixed offsets (order.py; where W is a row segment of a fused matrix,
the whole matrix's cut), a program per cut, each cut one chain of tensor-core dots from zero,
the last program of a row block adding the cuts in order (gemv.finish). So a row's bits are
gemv(x, dequantize_blocks(W), dot config, k_per_split=cut)'s, which are the workspace
route's (the GEMM with the same cuts) at every other width. A cut is a multiple of
order.SPLIT_ALIGN (256), so it begins on a block (256 values for the K-quants, 32 for Q8_0,
Q4_0, Q5_0), and a program reads whole blocks of its rows.

Against the int8 block GEMV (gemv_blocks.py): the same bytes read, x kept in the engine dtype
(not quantized), each weight made a float and multiplied on the tensor cores instead of integer
dot products on the codes. sm_90 code at a 64 x 128 tile, the loop's instructions per weight:
Q8_0 6.5, Q4_K 10.9, Q4_0 16.8, Q5_K 16.3, Q6_K 18.6, Q5_0 25.8 (the dense dot kind on bf16
weights: 1.8; the int8 block GEMV's Q4_K ~1.7): not yet timed on a GPU, decode may be bound
by these instructions rather than by the bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES

from muser.ops.blocks import KERNEL_TYPES, BlockMatrix
from muser.ops.triton.alloc import empty
from muser.ops.triton.arrive import counters
from muser.ops.triton.block_values import block_tile
from muser.ops.triton.gemv import DOT_ROWS, GemvConfig, finish, weight_rows, x_tile
from muser.ops.triton.launch import cdiv, launch, next_power_of_2
from muser.ops.triton.order import k_per_split
from muser.ops.triton.pdl import enter, options

# (weight rows, K step, warps, stages) worth timing, each K step dividing every cut; the last
# is the interpreter's, with the dense route's K step there (linear.EXACT_GEMV_TILES: the
# interpreter sums a dot's K step at once, the GPU 16 products a step whatever the tile)
TILES = ((64, 128, 4, 3), (32, 256, 4, 3), (128, 64, 8, 3), (64, 64, 4, 4), (32, 32, 4, 2))


@triton.jit
def _gemv_blocks_dot_kernel(
    x_ptr, w_ptr, d_ptr, out_ptr, part_ptr, cnt_ptr, N, M, K, stride_xn, stride_on, row_bytes,
    d_row, k_per_split, QTYPE: tl.constexpr, GEGLU: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):
    """Program (i, s): weight rows of block i (`weight_rows`) over cut s."""
    rows, valid = weight_rows(M, BLOCK_M, GEGLU)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_dtype = out_ptr.dtype.element_ty  # the engine's (the workspace's) dtype
    base = w_ptr + rows[:, None].to(tl.int64) * row_bytes
    d_base = d_ptr + rows[:, None].to(tl.int64) * d_row
    enter(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        w = block_tile(base, d_base, valid, k0, k_hi, QTYPE, BLOCK_M, BLOCK_K)
        x = x_tile(x_ptr, rn, kk, k_hi, N, stride_xn)
        # NOTE: the workspace's rounding of each value, then gemv._gemv_dot_kernel's dot
        acc = tl.dot(w.to(w_dtype), tl.trans(x.to(w_dtype)), acc, input_precision="ieee")
    finish(tl.trans(acc), rn, out_ptr, part_ptr, cnt_ptr, out_ptr, out_ptr, out_ptr, out_ptr, N,
           M, stride_on, 0, 0.0, w_dtype, GEGLU, False, 16, BLOCK_N, BLOCK_M, SPLIT_K)


def candidates_dot(n: int, m: int, k: int, cut: int) -> list[GemvConfig]:
    """The configs worth timing for one shape (the last: the interpreter's), split at `cut`."""
    splits = cdiv(k, cut)
    return [GemvConfig("dot", bm, bk, splits, warps, stages)
            for bm, bk, warps, stages in TILES if cut % bk == 0]


def linear_blocks_dot(x: torch.Tensor, weight: BlockMatrix, config: GemvConfig,
                      cut: int | None = None, out: torch.Tensor | None = None,
                      geglu: bool = False) -> torch.Tensor:
    """x: [N, K] any float, N <= DOT_ROWS; weight: [M, K] as blocks of a KERNEL_TYPES type ->
    y [N, M] in weight.dtype, or written into `out` ([N, M] of weight.dtype, rows of any
    stride: a column slice of a fused matrix's output); geglu: gelu_tanh(y[:, :M/2]) *
    y[:, M/2:] [N, M/2]. K is cut every `cut` columns (default: order.k_per_split of weight's
    shape; a row segment of a fused matrix takes the whole matrix's). Bits: gemv.gemv(x,
    dequantize_blocks(weight, weight.dtype), config, geglu, k_per_split=cut)'s."""
    n, (m, k), qtype, dtype = x.shape[0], weight.shape, weight.qtype, weight.dtype
    assert n <= DOT_ROWS and x.shape[1] == k and x.stride(-1) == 1
    assert qtype in KERNEL_TYPES and weight.data.is_contiguous() and config.kind == "dot"
    assert not (geglu and out is not None) and (not geglu or m % 2 == 0)
    cut = k_per_split(m, k) if cut is None else cut
    assert cut % config.block_k == 0 and cut % GGML_QUANT_SIZES[qtype][0] == 0, (cut, qtype)
    splits, row_blocks, dev = cdiv(k, cut), cdiv(m, config.block_m), x.device
    if out is None:
        out = empty((n, m // 2 if geglu else m), dtype, dev)
    assert out.dtype == dtype and out.shape == (n, m // 2 if geglu else m)
    assert out.stride(-1) == 1
    cnt = counters(dev, row_blocks) if splits > 1 else out
    part = empty((splits, n, m), torch.float32, dev) if splits > 1 else out
    d = weight.d if weight.d is not None else weight.data  # Q8_0's and Q6_K's (unread else)
    launch(_gemv_blocks_dot_kernel, (row_blocks, splits), x, weight.data, d, out, part, cnt, n,
           m, k, x.stride(0), out.stride(0), weight.data.stride(0), d.stride(0), cut,
           QTYPE=int(qtype), GEGLU=geglu, BLOCK_N=max(16, next_power_of_2(n)),
           BLOCK_M=config.block_m, BLOCK_K=config.block_k, SPLIT_K=splits,
           num_warps=config.num_warps, num_stages=config.num_stages, **options(dev))
    return out
