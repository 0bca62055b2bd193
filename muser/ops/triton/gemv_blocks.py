"""Decode GEMV over GGUF blocks: y[N, M] = x[N, K] @ W[M, K]^T for a few rows (N <= 8), W read
once as the file's bytes, so a step reads the file's size of weights, not its bf16 expansion.
Off the exact route only (block_weights.py): x quantized to int8 levels gives bits of its own,
not the workspace route's; the exact route's decode rows run gemv_blocks_dot.py.

Every block type is a scale times an integer code plus an offset per sub-block j of B values,
w_k = s_j q_k - t_j, so the sum runs per sub-block on the codes,

    y = sum_j s_j * (sum_{k in j} x_k q_k) - t_j * (sum_{k in j} x_k).

Every type takes x as two int8 levels per group of 32 values (int8_rows.py, made once per x
for every matrix that reads it: x^ = s_g (128 h + l)), so both inner sums are int32 sums: of
codes times h and times l in PTX dp4a (four an instruction, codes as bytes cut out of 32-bit
words: Q8_0's as they are, signed; Q4_K's high nibbles read in place as 16 q, unsigned; Q5_K's,
Q6_K's and Q5_0's high bits shifted onto their nibbles; Q4_0's and Q5_0's words joined from
int16 loads, their blocks being 2-byte aligned), and of 128 h + l (int8_rows' sums). Per
sub-block and row the float work is a few multiplies. (Why dp4a and not x as one int16 in
dp2a, or float FMAs on x: docs/gpu-notes.md, "GGUF blocks on the GPU".)

    type  B   words                                  s_j, t_j
    Q4_K  32  int32 0: d|dmin, 1-3: 12 scale bytes,   d sc_j, dmin m_j (6-bit sc, m)
              4 + 8g + i: codes of sub-blocks 2g (low nibbles) and 2g + 1 (high)
    Q5_K  32  int32 as Q4_K, with 4-11: high bits      as Q4_K
              (bit j of a byte: sub-block j), codes at 12 + 8g + i
    Q6_K  16  int32 0-31: low nibbles, 32-47: 2-bit   d sc_j, 32 d sc_j (int8 sc)
              highs, 48-51: 16 int8 scales (d apart: BlockMatrix)
    Q8_0  16  int32 0-7: 32 int8 codes (d apart)      d, 0  (a half block a sub-block)
    Q5_0  32  int16 0: d, 1-2: 32 high bits, 3-10     d, 16 d
    Q4_0  32  int16 0: d, 1-8: nibbles                d, 8 d

Tiles are 5-d, [n, block, group, m, word]: the words' axis (4) is in each thread, so a
sub-block's sums are summed in it. Every load of the loop is made in the code words' shape
(`_like`), x's too: a load of another shape takes a layout of its own, whose every use converts
through shared memory. Nothing is masked: blocks past a program's range and rows past M and N
read the last ones in range and add 0 (their x scale reads as 0) or are not stored. sm_90 code
at N = 1, the loop's instructions per weight at the first tile: Q4_K ~1.7, Q6_K ~2.7 (3.1 and
3.3 per byte).

Error: y is the product with x^ (|x - x^| <= s_g / 2, int8_rows.py). An integer sum is exact
and rounds at most once made a float (Q8_0's, up to 16 * 128 * 8256 > 2^24: B = 1; the
others' stay below 2^24: B = 0; Q4_0's and Q5_0's offsets are subtracted in the integers).
Then the scale multiply and offset subtraction, one each, the accumulators (T additions per
element and iteration), their final sum (at most BLOCKS E elements per output), the split's
partials and acc - off: any tree, each product reaching y through at most
D = B + 2 + T iterations + BLOCKS E + SPLIT_K + 1 roundings, so
|y - exact| <= gamma_D * sum_k |x_k| (|s_j q_k| + |t_j|) (tests/ops/test_blocks.py _depth).

A program handles BLOCK_M rows over its range of blocks (SPLIT_K ranges per row block), BLOCKS
blocks per iteration; split over K, the float32 partials are summed in a fixed order by the last
program of the row block to finish (gemv.finish): deterministic, as graph replay needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from muser.ops.blocks import KERNEL_TYPES, BlockMatrix
from muser.ops.triton.alloc import empty
from muser.ops.triton.arrive import counters
from muser.ops.triton.block_values import Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0
from muser.ops.triton.gemv import NormEpilogue, finish, outputs, weight_rows
from muser.ops.triton.int8_rows import Int8Rows, int8_rows
from muser.ops.triton.launch import cdiv, launch, next_power_of_2
from muser.ops.triton.pdl import enter, options

MAX_ROWS = 8
QT = GGMLQuantizationType
WORD16_TYPES = (QT.Q5_0, QT.Q4_0)  # 2-byte aligned blocks, read as int16 words


@triton.jit
def _f16(word):
    """The low 16 bits of an int16 / int32 word as an fp16 -> float32."""
    return word.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _ax(n: tl.constexpr, axis: tl.constexpr):
    """arange(n) along `axis` of the 5-d tiles [n, block, group, m, word]. NOTE: the rows
    (m) are the slowest axis of Triton's layout, so each thread holds several rows of the same
    words: the x values it loads serve all of them."""
    r = tl.arange(0, n)
    if axis == 1:
        return r[None, :, None, None, None]
    elif axis == 2:
        return r[None, None, :, None, None]
    else:
        tl.static_assert(axis == 4)
        return r[None, None, None, None, :]


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr, UNSIGNED: tl.constexpr = False):
    """c + the dot product of the four bytes of a (signed, or unsigned if UNSIGNED) and the four
    signed bytes of b (int32): PTX's dp4a, or its arithmetic where there is no PTX (the
    interpreter)."""
    if ASM:
        if UNSIGNED:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                             [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                             [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        for k in tl.static_range(4):
            if UNSIGNED:
                byte = (a >> 8 * k) & 0xFF
            else:
                byte = (a << (24 - 8 * k)) >> 24
            c += byte * ((b << (24 - 8 * k)) >> 24)
        return c


@triton.jit
def _like(ptr, like):
    """Load at `ptr` (any shape that broadcasts to `like`'s) as `like`'s shape, each thread what
    its own elements need. NOTE: so every load of the loop takes the code words' layout, and
    its sums over the words' axis the same slice of it; a load of another shape ([.., 1] per
    sub-block, [.., 1, ..] for x) takes a layout of its own, and each use of it then converts
    through shared memory, with barriers. No masks: a masked load zeroes its registers first."""
    return tl.load(tl.broadcast_to(ptr, like.shape))


@triton.jit
def _pick(v, i, k: tl.constexpr):
    """Element k of the words' axis: [..., 4] -> [...] (a register of the same thread)."""
    return tl.sum(tl.where(i == k, v, 0), axis=4)


@triton.jit
def _k4_scales(head, i, gg):
    """The 6-bit scales and mins of a Q4_K / Q5_K block's sub-blocks 4 (gg // 2)..+3, one a byte,
    from its words 1-3 (`head`: words 0-3 along the words' axis; ggml's get_scale_min_k4)."""
    w0, w1, w2 = _pick(head, i, 1), _pick(head, i, 2), _pick(head, i, 3)
    sc4 = tl.where(gg < 2, w0 & 0x3F3F3F3F, (w2 & 0x0F0F0F0F) | ((w0 >> 2) & 0x30303030))
    m4 = tl.where(gg < 2, w1 & 0x3F3F3F3F, ((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030))
    return sc4, m4


@triton.jit
def _k4(wrow, xh, xl, xs, xsum, b_lo, b_hi, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCKS: tl.constexpr, ASM: tl.constexpr, HIGH: tl.constexpr):
    """Q4_K, or Q5_K (HIGH): 256 values a block, 8 sub-blocks of 32 with 6-bit scales and mins.
    Q4_K: group g: code words 4 + 8g + 4u + i (two 16-byte loads, u) hold the codes of values
    32j + 16u + 4i + byte of sub-blocks j = 2g (low nibbles) and 2g + 1 (high, read in place
    as 16 q: a multiple of 16 in every sum, shifted out exactly). Q5_K: the same codes at words
    12 + 8g + 4u + i, after 32 bytes of high bits (words 4-11): word 4 + 4u + i holds in bit j
    of each byte the high bit of the same values of sub-block j, shifted onto bit 4 of the code
    bytes (codes 0-31, so both nibbles are read as signed bytes)."""
    g, i = _ax(4, 2), _ax(4, 4)
    zero = tl.zeros((BLOCK_N, BLOCKS, 4, BLOCK_M, 4), tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCKS, 4, BLOCK_M), tl.float32)
    gg = tl.sum(g, axis=4)  # g along the sums' axes
    for b0 in range(b_lo, b_hi, BLOCKS):
        # NOTE: blocks past the range read the last one (in bounds, finite) and their x scale
        # reads as 0, so they add 0: no load needs a mask (the ones of x rows past N neither)
        valid = b0 + _ax(BLOCKS, 1) < b_hi
        b = tl.minimum(b0 + _ax(BLOCKS, 1), b_hi - 1)
        blk = wrow + b * (44 if HIGH else 36)
        h0, l0, h1, l1 = zero, zero, zero, zero  # sum q h, q l of sub-blocks 2g, 2g + 1
        for u in tl.static_range(2):
            words = _like(blk + (12 if HIGH else 4) + 8 * g + 4 * u + i, zero)
            at = 64 * b + 16 * g + 4 * u + i  # x words of sub-block 2g; 2g + 1: 8 further
            if HIGH:
                qh = _like(blk + 4 + 4 * u + i, zero) >> (2 * g)
                low = (words & 0x0F0F0F0F) | ((qh & 0x01010101) << 4)
                high = ((words >> 4) & 0x0F0F0F0F) | ((qh & 0x02020202) << 3)
            else:
                low, high = words & 0x0F0F0F0F, words & ~0x0F0F0F0F
            h0 = _dp4a(low, _like(xh + at, zero), h0, ASM)
            l0 = _dp4a(low, _like(xl + at, zero), l0, ASM)
            if HIGH:
                h1 = _dp4a(high, _like(xh + at + 8, zero), h1, ASM)
                l1 = _dp4a(high, _like(xl + at + 8, zero), l1, ASM)
            else:
                h1 = _dp4a(high, _like(xh + at + 8, zero), h1, ASM, True)
                l1 = _dp4a(high, _like(xl + at + 8, zero), l1, ASM, True)
        # words 0-3 of the block: d | dmin, then the 12 bytes of 6-bit scales and mins: bytes
        # j, j + 4 for j < 4; for j >= 4, low nibbles of byte j + 4 and the top bits of j - 4, j
        # (ggml's get_scale_min_k4, four sub-blocks a word); x sums and scales of sub-blocks
        # 2g + i // 2
        head = _like(blk + i, zero)
        sc4, m4 = _k4_scales(head, i, gg)
        sums = _like(xsum + 8 * b + 2 * g + i // 2, zero)
        scales = tl.where(valid, _like(xs + 8 * b + 2 * g + i // 2, zero), 0.0)
        d, dmin = _f16(_pick(head, i, 0)), _f16(_pick(head, i, 0) >> 16)
        for hi in tl.static_range(2):  # sub-block j = 2g + hi: byte 2 (g % 2) + hi
            if hi == 0:
                t = tl.sum(128 * h0 + l0, axis=4)  # sum q (128 h + l): exact
            elif HIGH:
                t = tl.sum(128 * h1 + l1, axis=4)
            else:
                t = tl.sum(128 * h1 + l1, axis=4) >> 4
            at = 8 * (2 * (gg % 2) + hi)
            sc, m = ((sc4 >> at) & 0xFF).to(tl.float32), ((m4 >> at) & 0xFF).to(tl.float32)
            x_sum = _pick(sums, i, 2 * hi).to(tl.float32)
            acc += _pick(scales, i, 2 * hi) * ((d * sc) * t.to(tl.float32) - (dmin * m) * x_sum)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _q6_k(wrow, drow, xh, xl, xs, xsum, b_lo, b_hi, BLOCK_N: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr, ASM: tl.constexpr):
    # group g = 2h + u: half h of the block, u: which 16 of each 32 values there. Words i of
    # low nibbles A, B and 2-bit highs Q (16-byte loads: the blocks' 208 bytes without d,
    # BlockMatrix) give the codes of values 128h + 32a + 16u + 4i + byte: a = 0, 2 the low,
    # high nibbles of A; 1, 3 of B
    g, i = _ax(4, 2), _ax(4, 4)
    h, u = g // 2, g % 2
    zero = tl.zeros((BLOCK_N, BLOCKS, 4, BLOCK_M, 4), tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCKS, 4, BLOCK_M), tl.float32)
    for b0 in range(b_lo, b_hi, BLOCKS):
        valid = b0 + _ax(BLOCKS, 1) < b_hi  # past the range: as Q4_K's
        b = tl.minimum(b0 + _ax(BLOCKS, 1), b_hi - 1)
        blk = wrow + b * 52
        word_a = _like(blk + 16 * h + 4 * u + i, zero)
        word_b = _like(blk + 16 * h + 8 + 4 * u + i, zero)
        word_q = _like(blk + 32 + 8 * h + 4 * u + i, zero)
        # along the words' axis, a = i: the int8 scales of sub-blocks 8h + 2a + u (byte u of
        # int16 word 96 + 4h + a), x sums of those 16 values, x scales of their 32
        scales = _like(blk.to(tl.pointer_type(tl.int16)) + 96 + 4 * h + i, zero).to(tl.int32)
        sc = ((scales << (24 - 8 * u)) >> 24).to(tl.float32) * _like(
            drow + b, zero).to(tl.float32)  # d times the int8 scale: exact
        sums = _like(xsum + 16 * b + 8 * u + 4 * h + i, zero)  # Int8Rows.half_sums' order
        xscale = tl.where(valid, _like(xs + 8 * b + 4 * h + i, zero), 0.0)
        for a in tl.static_range(4):  # sub-block v = 8h + 2a + u of 16 values
            low = ((word_a if a % 2 == 0 else word_b) >> (4 * (a // 2))) & 0x0F0F0F0F
            if a < 2:  # bits 2a, 2a + 1 of each byte of Q to bits 4, 5
                high = (word_q << (4 - 2 * a)) & 0x30303030
            else:
                high = (word_q >> (2 * a - 4)) & 0x30303030
            codes = low | high
            at = 64 * b + 32 * h + 8 * a + 4 * u + i
            hs = _dp4a(codes, _like(xh + at, zero), zero, ASM)
            ls = _dp4a(codes, _like(xl + at, zero), zero, ASM)
            # sum (code - 32)(128 h + l): exact
            t = tl.sum(128 * hs + ls, axis=4) - 32 * _pick(sums, i, a)
            acc += _pick(sc, i, a) * (_pick(xscale, i, a) * t.to(tl.float32))
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _q8_0(wrow, drow, xh, xl, xs, b_lo, b_hi, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCKS: tl.constexpr, ASM: tl.constexpr):
    # half g of block b: code words 8b + 4g + i (a 16-byte load) hold the codes of values
    # 32b + 16g + 4i + byte, x's words the same values' h and l
    g, i = _ax(2, 2), _ax(4, 4)
    zero = tl.zeros((BLOCK_N, BLOCKS, 2, BLOCK_M, 4), tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCKS, 2, BLOCK_M), tl.float32)
    for b0 in range(b_lo, b_hi, BLOCKS):
        valid = b0 + _ax(BLOCKS, 1) < b_hi  # past the range: as Q4_K's
        b = tl.minimum(b0 + _ax(BLOCKS, 1), b_hi - 1)
        at = 8 * b + 4 * g + i
        codes = _like(wrow + at, zero)
        hs = _dp4a(codes, _like(xh + at, zero), zero, ASM)
        ls = _dp4a(codes, _like(xl + at, zero), zero, ASM)
        t = tl.sum(128 * hs + ls, axis=4)  # sum q (128 h + l) over 16 values: exact in int32
        # d times the x scale (a power of two): exact
        scale = _like(drow + b, zero).to(tl.float32) * tl.where(valid, _like(xs + b, zero), 0.0)
        acc += _pick(scale, i, 0) * t.to(tl.float32)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _q32(wrow, xh, xl, xs, xsum, b_lo, b_hi, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCKS: tl.constexpr, ASM: tl.constexpr, HIGH: tl.constexpr):
    """Blocks of 32 values of 4-bit codes in int16 words (2-byte aligned blocks): Q5_0 (HIGH:
    words 0: d, 1-2: 32 high bits, 3-10: the nibbles; x = d (q - 16)) or Q4_0 (0: d, 1-8: the
    nibbles; x = d (q - 8)). Code word i (int16 words 2i, 2i + 1 of the nibbles, joined) holds
    values 4i + byte in its low nibbles and 16 + 4i + byte in its high ones; Q5_0's high bits
    4i..4i + 3 and 16 + 4i.. are spread onto bit 4 of its bytes by one multiply (bit e to bit 8e:
    the shifts 7e of 1 + 2^7 + 2^14 + 2^21 never overlap for e < 4)."""
    i = _ax(4, 4)
    zero = tl.zeros((BLOCK_N, BLOCKS, 1, BLOCK_M, 4), tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCKS, 1, BLOCK_M), tl.float32)
    for b0 in range(b_lo, b_hi, BLOCKS):
        valid = b0 + _ax(BLOCKS, 1) < b_hi  # past the range: as Q4_K's
        b = tl.minimum(b0 + _ax(BLOCKS, 1), b_hi - 1)
        blk = wrow + b * (11 if HIGH else 9)
        at = (3 if HIGH else 1) + 2 * i
        words = (_like(blk + at, zero).to(tl.int32) & 0xFFFF) | (
            _like(blk + at + 1, zero).to(tl.int32) << 16)
        low, high = words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F
        if HIGH:
            qh = (_like(blk + 1, zero).to(tl.int32) & 0xFFFF) | (
                _like(blk + 2, zero).to(tl.int32) << 16)
            low |= ((((qh >> 4 * i) & 0xF) * 0x00204081) & 0x01010101) << 4
            high |= ((((qh >> (16 + 4 * i)) & 0xF) * 0x00204081) & 0x01010101) << 4
        hs = _dp4a(high, _like(xh + 8 * b + 4 + i, zero), _dp4a(low, _like(xh + 8 * b + i, zero),
                                                                 zero, ASM), ASM)
        ls = _dp4a(high, _like(xl + 8 * b + 4 + i, zero), _dp4a(low, _like(xl + 8 * b + i, zero),
                                                                 zero, ASM), ASM)
        # sum (q - 16 or 8)(128 h + l) over the block: exact in int32 (|.| <= 32 16 8256)
        t = tl.sum(128 * hs + ls, axis=4) - (16 if HIGH else 8) * _pick(
            _like(xsum + b, zero), i, 0)
        # d times the x scale (a power of two): exact
        scale = _f16(_like(blk, zero).to(tl.int32)) * tl.where(valid, _like(xs + b, zero), 0.0)
        scale = _pick(scale, i, 0)
        acc += scale * t.to(tl.float32)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _gemv_blocks_kernel(xh_ptr, xl_ptr, xs_ptr, xsum_ptr, xhalf_ptr, w_ptr, wd_ptr, like_ptr,
                        out_ptr, part_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr, N, M,
                        row_words, stride_on, stride_rn, blocks, blocks_per_split, eps,
                        QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCKS: tl.constexpr, SPLIT_K: tl.constexpr, GEGLU: tl.constexpr,
                        NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, ASM: tl.constexpr,
                        PDL: tl.constexpr):
    rn = tl.arange(0, BLOCK_N)
    rm, _ = weight_rows(M, BLOCK_M, GEGLU)
    b_lo = tl.program_id(1) * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, blocks)
    # rows past N and M read the last ones (not stored): no load needs a mask
    xn = tl.minimum(rn[:, None, None, None, None], N - 1)
    row = tl.minimum(rm[None, None, None, :, None], M - 1).to(tl.int64)
    enter(PDL)
    if QTYPE == Q4_K or QTYPE == Q5_K or QTYPE == Q6_K:
        # x per row and block: 64 words of h and of l, 8 scales, 8 sums, 16 half sums
        xh, xl = xh_ptr + xn * (64 * blocks), xl_ptr + xn * (64 * blocks)
        xs = xs_ptr + xn * (8 * blocks)
        if QTYPE == Q4_K or QTYPE == Q5_K:  # 144- / 176-byte blocks: rows of 16-byte multiples
            # (the loads' alignment)
            acc = _k4(w_ptr + row * (row_words // 4 * 4), xh, xl, xs,
                      xsum_ptr + xn * (8 * blocks), b_lo, b_hi, BLOCK_N, BLOCK_M, BLOCKS, ASM,
                      QTYPE == Q5_K)
        else:
            acc = _q6_k(w_ptr + row * (row_words // 4 * 4), wd_ptr + row * blocks, xh, xl, xs,
                        xhalf_ptr + xn * (16 * blocks), b_lo, b_hi, BLOCK_N, BLOCK_M, BLOCKS,
                        ASM)
    elif QTYPE == Q8_0:  # x per row and block of 32: 8 words of h and of l, a scale
        acc = _q8_0(w_ptr + row * (row_words // 4 * 4), wd_ptr + row * blocks,
                    xh_ptr + xn * (8 * blocks), xl_ptr + xn * (8 * blocks), xs_ptr + xn * blocks,
                    b_lo, b_hi, BLOCK_N, BLOCK_M, BLOCKS, ASM)
    else:  # as Q8_0's, and a sum per block of 32
        tl.static_assert(QTYPE == Q5_0 or QTYPE == Q4_0,
                         "the block GEMV reads Q4_0, Q5_0, Q8_0 and the K-quants")
        acc = _q32(w_ptr + row * row_words, xh_ptr + xn * (8 * blocks), xl_ptr + xn * (8 * blocks),
                   xs_ptr + xn * blocks, xsum_ptr + xn * blocks, b_lo, b_hi, BLOCK_N, BLOCK_M,
                   BLOCKS, ASM, QTYPE == Q5_0)
    # y rounded to like_ptr's dtype (the projection's) before an epilogue, as the ops apart
    finish(acc, rn, out_ptr, part_ptr, cnt_ptr, res_ptr, post_ptr, next_ptr, res_out_ptr, N, M,
           stride_on, stride_rn, eps, like_ptr.dtype.element_ty, GEGLU, NORM, NORM_BLOCK,
           BLOCK_N, BLOCK_M, SPLIT_K)


@dataclass(frozen=True)
class BlockGemvConfig:
    block_m: int  # weight rows per program
    blocks: int  # blocks (super-blocks for Q4_K / Q6_K) per loop iteration
    split_k: int  # programs per row block, each over a range of the blocks
    num_warps: int
    num_stages: int = 3


# (block_m, blocks, num_warps) worth timing per type, best first: the K-quants' by H200 times
# at the gemma3-27b shapes (bench/blocks_gemv.py --explore); Q8_0's load as many bytes of codes
# a thread per iteration as Q4_K's first tile (128 at N = 1); Q5_0's and Q4_0's (32 values a
# block too) are Q8_0's, not yet timed
_TILES = {QT.Q4_K: [(32, 4, 4), (16, 4, 2), (64, 1, 4), (64, 4, 8)],
          QT.Q6_K: [(32, 4, 4), (16, 4, 2), (32, 2, 4), (64, 1, 4)],
          QT.Q8_0: [(32, 16, 4), (16, 16, 2), (64, 8, 4), (32, 32, 8)],
          QT.Q5_0: [(32, 16, 4), (16, 16, 2), (64, 8, 4), (32, 32, 8)],
          QT.Q5_K: [(32, 4, 4), (16, 4, 2), (64, 1, 4), (64, 4, 8)],  # Q4_K's, not yet timed
          QT.Q4_0: [(32, 16, 4), (16, 16, 2), (64, 8, 4), (32, 32, 8)]}
_CODES_PER_THREAD = 256  # register budget: x rows x codes a thread holds per iteration


def _config(n: int, m: int, k: int, qtype: QT, block_m: int, blocks: int, num_warps: int,
            split_k: int) -> BlockGemvConfig:
    """block_m capped so an iteration's N x BLOCK_M x weights products fit the registers."""
    weights = blocks * GGML_QUANT_SIZES[qtype][0]
    most = _CODES_PER_THREAD * 32 * num_warps // (next_power_of_2(n) * weights)
    return BlockGemvConfig(max(1, min(block_m, next_power_of_2(most + 1) // 2)), blocks,
                           split_k, num_warps)


def _splits(m: int, k: int, qtype: QT, c: BlockGemvConfig) -> tuple[int, int]:
    """(SPLIT_K that brings the launch to about 1024 programs, the most the blocks allow)."""
    most = min(max(1, k // GGML_QUANT_SIZES[qtype][0] // c.blocks), 16)
    return min(next_power_of_2(cdiv(1024, cdiv(m, c.block_m))), most), most


def default_config(n: int, m: int, k: int, qtype: QT) -> BlockGemvConfig:
    """The type's first tile, split over K until about 1024 programs run."""
    c = _config(n, m, k, qtype, *_TILES[qtype][0], 1)
    return BlockGemvConfig(c.block_m, c.blocks, _splits(m, k, qtype, c)[0], c.num_warps)


def candidates_blocks(n: int, m: int, k: int, qtype: QT) -> list[BlockGemvConfig]:
    """Configs worth timing for one shape: each of the type's tiles at the split that fills the
    chip, the first tile also at half and twice that split."""
    out = []
    for first, tile in zip([True] + [False] * 3, _TILES[qtype]):
        c = _config(n, m, k, qtype, *tile, 1)
        fill, most = _splits(m, k, qtype, c)
        for split in sorted({max(1, fill // 2), fill, min(2 * fill, most)} if first else {fill}):
            out.append(BlockGemvConfig(c.block_m, c.blocks, split, c.num_warps))
    return list(dict.fromkeys(out))


def _words(data: torch.Tensor, qtype: QT) -> torch.Tensor:
    """The blocks' bytes as the words the kernel loads: int16 for Q5_0 and Q4_0, int32 for the
    others (Q8_0's codes and Q6_K's 208-byte blocks without d)."""
    dtype = torch.int16 if qtype in WORD16_TYPES else torch.int32
    size = dtype.itemsize
    assert data.data_ptr() % size == 0 and data.shape[1] % size == 0, "blocks not word aligned"
    return data.view(dtype)


def linear_blocks(x: torch.Tensor, weight: BlockMatrix, config: BlockGemvConfig | None = None,
                  out: torch.Tensor | None = None, rows: Int8Rows | None = None,
                  geglu: bool = False, norm: NormEpilogue | None = None):
    """x: [N, K] (float32, or 16-bit: read as float32), N <= 8; weight: [M, K] as blocks of a
    KERNEL_TYPES type -> [N, M] float32 (ref.linear_blocks), or written into `out` ([N, M] of
    any float dtype, rows of any stride: e.g. a column slice of a wider output). x is read as
    `rows` (int8_rows(x), made here when not given: one per x serves every matrix).
    With `geglu` or `norm`, gemv.gemv's epilogues on y in weight.dtype, and its results."""
    n, (m, k), qtype = x.shape[0], weight.shape, weight.qtype
    assert n <= MAX_ROWS and x.shape[1] == k and x.stride(-1) == 1 and x.dtype.is_floating_point
    assert qtype in KERNEL_TYPES and weight.data.is_contiguous()
    assert not (geglu and norm) and (not geglu or m % 2 == 0) and (out is None or not (
        geglu or norm))
    c = config or default_config(n, m, k, qtype)
    dev = x.device
    rows = rows if rows is not None else int8_rows(x)
    assert rows.hi.shape == (n, k // 4)
    words = _words(weight.data, qtype)
    blocks = k // GGML_QUANT_SIZES[qtype][0]
    block_m = max(c.block_m, 2) if geglu else c.block_m  # a gate and an up row at least
    per_split = cdiv(cdiv(blocks, c.split_k), c.blocks) * c.blocks
    splits, row_blocks = cdiv(blocks, per_split), cdiv(m, block_m)
    if geglu or norm is not None:
        o = outputs(n, m, weight.dtype, splits, row_blocks, geglu, norm, dev)
        args, result = o.args, o.result
        # NOTE: only its dtype is read (the projection's, to round y to before the epilogue)
        like = args[0] if norm is None else args[6].view(weight.dtype)
    else:
        if out is None:
            out = empty((n, m), torch.float32, dev)
        assert out.shape == (n, m) and out.stride(-1) == 1
        cnt = counters(dev, row_blocks) if splits > 1 else out
        part = empty((splits, n, m), torch.float32, dev) if splits > 1 else out
        args, result, like = (out, part, cnt, out, out, out, out), out, out
        o = None
    d = weight.d if weight.d is not None else words  # Q6_K's d (unread otherwise)
    launch(_gemv_blocks_kernel, (row_blocks, splits), *rows, words, d, like, *args, n, m,
           words.shape[1], args[0].stride(0), 0 if o is None else o.stride_rn,
           blocks, per_split, 0.0 if o is None else o.eps, QTYPE=int(qtype),
           BLOCK_N=max(1, next_power_of_2(n)), BLOCK_M=block_m, BLOCKS=c.blocks,
           SPLIT_K=splits, GEGLU=geglu, NORM=norm is not None,
           NORM_BLOCK=min(next_power_of_2(m), 4096), ASM=x.is_cuda, num_warps=c.num_warps,
           num_stages=c.num_stages, **options(dev))
    return result
