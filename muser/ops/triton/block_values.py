"""Weights read straight from GGUF blocks inside a kernel: W[rows, cols] in float32 with ggml's
arithmetic in ggml's order, so the values are bit for bit `gguf.quants.dequantize`'s. The
roundings are the same ones: most products here are exact in float32 (an fp16 scale of 11
significant bits times codes of at most 6 + 5 bits), Q4_K's final subtraction rounds once
(fused into a multiply-add or not: the product before it is exact), and Q6_K's 19-bit scale
times its 6-bit code rounds once, as gguf's float32 product does.

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
def q8_0_values(base, kk, mask, d_base):
    """Q8_0: 32 values of int8 codes q (a row: K bytes) and an fp16 d kept apart; x = d * q."""
    q = tl.load(base + kk, mask=mask, other=0).to(tl.int8, bitcast=True)
    d = tl.load(d_base + kk // 32, mask=mask, other=0.0).to(tl.float32)
    return d * q.to(tl.float32)


@triton.jit
def q5_0_values(base, kk, mask):
    """Q5_0: 32 values in 22 bytes (fp16 d, 32 high bits as a little-endian u32, 16 bytes of
    nibbles: values 0-15 low, 16-31 high); x = d * (q - 16)."""
    block = base + (kk // 32) * 22
    j = kk % 32
    high = (_byte(block + 2 + j // 8, mask) >> (j % 8)) & 1
    low = (_byte(block + 6 + j % 16, mask) >> (4 * (j // 16))) & 0xF
    return _f16(block, mask) * ((low | (high << 4)) - 16).to(tl.float32)


@triton.jit
def q4_0_values(base, kk, mask):
    """Q4_0: 32 values in 18 bytes (fp16 d, 16 bytes of nibbles: values 0-15 low, 16-31
    high); x = d * (q - 8)."""
    block = base + (kk // 32) * 18
    j = kk % 32
    q = (_byte(block + 2 + j % 16, mask) >> (4 * (j // 16))) & 0xF
    return _f16(block, mask) * (q - 8).to(tl.float32)


@triton.jit
def q6_k_values(base, kk, mask, d_base):
    """Q6_K: 256 values in 208 bytes (128 bytes of low nibbles, 64 of 2-bit highs, 16 int8
    scales of 16 values each) and an fp16 d kept apart. In half h = j // 128, value
    l = j % 128 takes the low (l < 64) or high nibble of byte 64h + l % 64 and bits 2 (l // 32)
    of byte 128 + 32h + l % 32; x = (d * scale) * (q - 32)."""
    block = base + (kk // 256) * 208
    j = kk % 256
    h, l = j // 128, j % 128
    low = (_byte(block + 64 * h + l % 64, mask) >> (4 * (l // 64))) & 0xF
    high = (_byte(block + 128 + 32 * h + l % 32, mask) >> (2 * (l // 32))) & 3
    scale = tl.load(block + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
    d = tl.load(d_base + kk // 256, mask=mask, other=0.0).to(tl.float32)
    return (d * scale.to(tl.float32)) * ((low | (high << 4)) - 32).to(tl.float32)


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


@triton.jit
def q4_k_values(base, kk, mask):
    """Q4_K: 256 values in 144 bytes (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for
    8 sub-blocks of 32, 128 bytes of nibbles: bytes 32g..32g+31 hold sub-block 2g in their low
    nibbles, 2g+1 in their high ones); x = (d * sc) * q - (dmin * m)."""
    block = base + (kk // 256) * 144
    j = kk % 256
    s = j // 32  # sub-block
    sc, m = _k4_scale_min(block, s, mask)
    q = (_byte(block + 16 + (s // 2) * 32 + j % 32, mask) >> (4 * (s % 2))) & 0xF
    d1 = _f16(block, mask) * sc.to(tl.float32)
    m1 = _f16(block + 2, mask) * m.to(tl.float32)
    return d1 * q.to(tl.float32) - m1


@triton.jit
def q5_k_values(base, kk, mask):
    """Q5_K: 256 values in 176 bytes (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins as
    Q4_K's, 32 bytes of high bits: bit s of byte l is value l of sub-block s, 128 bytes of
    nibbles as Q4_K's); x = (d * sc) * (q + 16 h) - (dmin * m)."""
    block = base + (kk // 256) * 176
    j = kk % 256
    s = j // 32
    sc, m = _k4_scale_min(block, s, mask)
    high = (_byte(block + 16 + j % 32, mask) >> s) & 1
    q = ((_byte(block + 48 + (s // 2) * 32 + j % 32, mask) >> (4 * (s % 2))) & 0xF) | (high << 4)
    d1 = _f16(block, mask) * sc.to(tl.float32)
    m1 = _f16(block + 2, mask) * m.to(tl.float32)
    return d1 * q.to(tl.float32) - m1


@triton.jit
def block_values(base, kk, mask, d_base, QTYPE: tl.constexpr):
    """W[rows, kk] float32 of blocks of type QTYPE (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K;
    `d_base`: Q8_0's and Q6_K's d pointers, unread otherwise)."""
    if QTYPE == Q8_0:
        return q8_0_values(base, kk, mask, d_base)
    elif QTYPE == Q4_0:
        return q4_0_values(base, kk, mask)
    elif QTYPE == Q5_0:
        return q5_0_values(base, kk, mask)
    elif QTYPE == Q4_K:
        return q4_k_values(base, kk, mask)
    elif QTYPE == Q5_K:
        return q5_k_values(base, kk, mask)
    else:
        tl.static_assert(QTYPE == Q6_K, "block_values reads Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K")
        return q6_k_values(base, kk, mask, d_base)
