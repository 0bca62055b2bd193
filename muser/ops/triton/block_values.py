"""Weights read straight from GGUF blocks inside a kernel: W[rows, cols] in float32 with ggml's
arithmetic in ggml's order, so the values are bit for bit `gguf.quants.dequantize`'s. The
roundings are the same ones: most products here are exact in float32 (an fp16 scale of 11
significant bits times codes of at most 6 + 5 bits), Q4_K's final subtraction rounds once
(fused into a multiply-add or not: the product before it is exact), and Q6_K's 19-bit scale
times its 6-bit code rounds once, as gguf's float32 product does.

Two readers of the same values: `block_values` per element (the workspace's dequantization,
dequantize_blocks.py), `block_tile` a [BLOCK_M, BLOCK_K] tile of whole sub-blocks with each
sub-block's scales loaded once (the exact route's block GEMV, gemv_blocks_dot.py). Both apply
one set of functions (`_scales`, `_codes`, `_combine`) to the same operands, and every
operation is elementwise: a value's bits do not depend on the reader or the tile.

`base`: [BLOCK_M, 1] pointers to the first byte of each weight row; `kk`: [1, BLOCK_K] column
indices; `mask`: [BLOCK_M, BLOCK_K] which elements exist (others read as 0). Q8_0's and
Q6_K's fp16 d are kept apart from their blocks (muser.ops.blocks.BlockMatrix; `d_base`:
[BLOCK_M, 1] pointers to each row's).
"""

from __future__ import annotations

import triton
import triton.language as tl

Q4_0 = tl.constexpr(2)  # GGMLQuantizationType values
Q5_0 = tl.constexpr(6)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)


@triton.jit
def _f16(ptr, mask):
    """A little-endian fp16 at byte address `ptr`, as float32 (bytes assembled: no alignment)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k4_scale_min(block, s, mask):
    """The 6-bit scale and min of sub-block s of 8 from a Q4_K / Q5_K block's 12 bytes at
    block + 4 (ggml's get_scale_min_k4)."""
    a = _byte(block + 4 + s % 4, mask)  # scales[s] (s < 4) or scales[s - 4]
    b = _byte(block + 8 + s, mask)  # scales[s + 4]
    c = _byte(block + 4 + s, mask)  # scales[s]
    low = s < 4
    sc = tl.where(low, a & 63, (b & 0xF) | ((a >> 6) << 4))
    m = tl.where(low, b & 63, (b >> 4) | ((c >> 6) << 4))
    return sc, m


# Each type as three parts (B: values a block; S: values sharing a scale, its sub-block): the
# scales of sub-block s of a block (`_scales` -> a, b), the integer code of value l of it, its
# offset subtracted (`_codes`), and their one formula (`_combine`): x = a * q, or a * q - b for
# Q4_K and Q5_K. block_values applies them per element; block_tile per sub-block and value, the
# scales loaded once a sub-block: the same operations on the same operands, so the same values.
#
#     type  B    S   bytes  a, b                      q
#     Q8_0  32   32  32     d (kept apart)            int8 code
#     Q5_0  32   32  22     d                         5-bit code - 16
#     Q4_0  32   32  18     d                         4-bit code - 8
#     Q4_K  256  32  144    d * sc, dmin * m          4-bit code
#     Q5_K  256  32  176    d * sc, dmin * m          5-bit code
#     Q6_K  256  16  208    d (kept apart) * int8 sc  6-bit code - 32


@triton.jit
def _scales(block, s, mask, d_at, QTYPE: tl.constexpr):
    """Sub-block s's (a, b), float32 (b: 0 but for Q4_K, Q5_K). block: pointers to each block's
    first byte; d_at: Q8_0's and Q6_K's pointers to the block's d (unread otherwise)."""
    if QTYPE == Q8_0:
        return tl.load(d_at, mask=mask, other=0.0).to(tl.float32), 0.0
    elif QTYPE == Q5_0 or QTYPE == Q4_0:
        return _f16(block, mask), 0.0
    elif QTYPE == Q6_K:
        scale = tl.load(block + 192 + s, mask=mask, other=0).to(tl.int8, bitcast=True)
        return tl.load(d_at, mask=mask, other=0.0).to(tl.float32) * scale.to(tl.float32), 0.0
    else:
        tl.static_assert(QTYPE == Q4_K or QTYPE == Q5_K, "Q4_0, Q5_0, Q8_0 and the K-quants")
        sc, m = _k4_scale_min(block, s, mask)
        return _f16(block, mask) * sc.to(tl.float32), _f16(block + 2, mask) * m.to(tl.float32)


@triton.jit
def _codes(block, s, l, mask, QTYPE: tl.constexpr):
    """The int32 code of value l of sub-block s, its offset subtracted."""
    if QTYPE == Q8_0:
        return tl.load(block + l, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int32)
    elif QTYPE == Q5_0:  # fp16 d, 32 high bits (4 bytes), 16 bytes of nibbles (0-15 low)
        high = (_byte(block + 2 + l // 8, mask) >> (l % 8)) & 1
        low = (_byte(block + 6 + l % 16, mask) >> (4 * (l // 16))) & 0xF
        return (low | (high << 4)) - 16
    elif QTYPE == Q4_0:  # fp16 d, 16 bytes of nibbles (values 0-15 low, 16-31 high)
        return ((_byte(block + 2 + l % 16, mask) >> (4 * (l // 16))) & 0xF) - 8
    elif QTYPE == Q6_K:  # value j = 16 s + l: half h = j // 128, i = j % 128 in it
        j = 16 * s + l
        h, i = j // 128, j % 128
        low = (_byte(block + 64 * h + i % 64, mask) >> (4 * (i // 64))) & 0xF
        high = (_byte(block + 128 + 32 * h + i % 32, mask) >> (2 * (i // 32))) & 3
        return (low | (high << 4)) - 32
    elif QTYPE == Q4_K:  # bytes 32g..32g+31 of the nibbles: sub-block 2g low, 2g + 1 high
        return (_byte(block + 16 + (s // 2) * 32 + l, mask) >> (4 * (s % 2))) & 0xF
    else:
        tl.static_assert(QTYPE == Q5_K, "Q4_0, Q5_0, Q8_0 and the K-quants")
        high = (_byte(block + 16 + l, mask) >> s) & 1  # bit s of byte l: sub-block s
        low = (_byte(block + 48 + (s // 2) * 32 + l, mask) >> (4 * (s % 2))) & 0xF
        return low | (high << 4)


@triton.jit
def _combine(a, b, q, QTYPE: tl.constexpr):
    """The value: a * q (- b for Q4_K, Q5_K: after an exact product, so fused or not alike)."""
    if QTYPE == Q4_K or QTYPE == Q5_K:
        return a * q.to(tl.float32) - b
    else:
        return a * q.to(tl.float32)


@triton.jit
def _values(base, kk, mask, d_base, B: tl.constexpr, S: tl.constexpr, BYTES: tl.constexpr,
            QTYPE: tl.constexpr):
    block = base + (kk // B) * BYTES
    j = kk % B
    a, b = _scales(block, j // S, mask, d_base + kk // B, QTYPE)
    return _combine(a, b, _codes(block, j // S, j % S, mask, QTYPE), QTYPE)


@triton.jit
def _tile(base, d_base, valid, k0, k_hi, B: tl.constexpr, S: tl.constexpr,
          BYTES: tl.constexpr, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr):
    tl.static_assert(BLOCK_K % S == 0, "a tile of whole sub-blocks")
    sub = k0 // S + tl.arange(0, BLOCK_K // S)[None, :, None]  # the row's sub-blocks [1, T, 1]
    k = sub * S  # their first columns
    block = base[:, :, None] + (k // B) * BYTES  # [BLOCK_M, T, 1]
    # NOTE: K and k_hi are multiples of S (whole blocks, cuts of 256): a sub-block is in or out
    mask = valid[:, None, None] & (k < k_hi)
    a, b = _scales(block, sub % (B // S), mask, d_base[:, :, None] + k // B, QTYPE)
    q = _codes(block, sub % (B // S), tl.arange(0, S)[None, None, :], mask, QTYPE)
    return tl.reshape(_combine(a, b, q, QTYPE), (BLOCK_M, BLOCK_K))


@triton.jit
def block_values(base, kk, mask, d_base, QTYPE: tl.constexpr):
    """W[rows, kk] float32 of blocks of type QTYPE (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K;
    `d_base`: Q8_0's and Q6_K's d pointers, unread otherwise)."""
    if QTYPE == Q8_0:  # a row: K bytes of codes
        return _values(base, kk, mask, d_base, 32, 32, 32, QTYPE)
    elif QTYPE == Q5_0:
        return _values(base, kk, mask, d_base, 32, 32, 22, QTYPE)
    elif QTYPE == Q4_0:
        return _values(base, kk, mask, d_base, 32, 32, 18, QTYPE)
    elif QTYPE == Q4_K:
        return _values(base, kk, mask, d_base, 256, 32, 144, QTYPE)
    elif QTYPE == Q5_K:
        return _values(base, kk, mask, d_base, 256, 32, 176, QTYPE)
    else:
        return _values(base, kk, mask, d_base, 256, 16, 208, QTYPE)


@triton.jit
def block_tile(base, d_base, valid, k0, k_hi, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """W[rows, k0 .. k0 + BLOCK_K) float32 [BLOCK_M, BLOCK_K]: block_values' values (0 in rows
    not `valid` and at k_hi and past), each sub-block's scales loaded once. base, d_base:
    [BLOCK_M, 1] pointers to each row's first byte and d; k0: a multiple of the sub-block."""
    if QTYPE == Q8_0:
        return _tile(base, d_base, valid, k0, k_hi, 32, 32, 32, QTYPE, BLOCK_M, BLOCK_K)
    elif QTYPE == Q5_0:
        return _tile(base, d_base, valid, k0, k_hi, 32, 32, 22, QTYPE, BLOCK_M, BLOCK_K)
    elif QTYPE == Q4_0:
        return _tile(base, d_base, valid, k0, k_hi, 32, 32, 18, QTYPE, BLOCK_M, BLOCK_K)
    elif QTYPE == Q4_K:
        return _tile(base, d_base, valid, k0, k_hi, 256, 32, 144, QTYPE, BLOCK_M, BLOCK_K)
    elif QTYPE == Q5_K:
        return _tile(base, d_base, valid, k0, k_hi, 256, 32, 176, QTYPE, BLOCK_M, BLOCK_K)
    else:
        return _tile(base, d_base, valid, k0, k_hi, 256, 16, 208, QTYPE, BLOCK_M, BLOCK_K)
