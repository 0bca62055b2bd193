"""The FP8 KV cache's rows (`--kv-cache-dtype fp8`): e4m3 codes with a power-of-two scale per
(token row, KV head), packed beside the codes in the same row.

A cache row of one KV head is PACKED(D) = D + 4 bytes (the store is uint8 [rows, KVH, D + 4]):

    bytes 0 .. D - 1 ..... the head's D values as e4m3 codes ("fn": finite, +-448)
    byte  D .............. the scale's biased float32 exponent e (1 .. 254): scale = 2^(e - 127)
    bytes D + 1 .. D + 3 . zero

The scale is `fp8.activation_scales`' rule, the one the FP8 activations use: the smallest power
of two p with amax <= 448 p over the head's values, computed on the float32 bits. Dividing by a
power of two is exact, so a code is the value's own e4m3 rounding (nearest, ties to even), and
dequantizing (code * p) is one exact multiply whose result every 16-bit float holds: what the
kernels read is a deterministic function of what was stored, at every route. Keeping the scale
in the row makes every byte copy of the cache (forks, prefix pages, ring checkpoints, the host
tier, snapshots, slot files, the disaggregation wire) carry it with no code of its own.

Error model (`tests/ops/test_kv_fp8.py`): e4m3 keeps 3 mantissa bits, so for |x| >= 2^-6 p,
|x - dequantized| <= 2^-4 |x|; below, among the subnormals (spacing 2^-9 p), <= 2^-10 p; and
p < amax / 224. Bytes a row: D + 4 against 2 D for bfloat16 (1.94x the tokens at D = 128,
1.97x at D = 256).
"""

from __future__ import annotations

import torch

from muser.ops.fp8 import FP8, FP8_MAX, activation_scales

PAD = 4  # bytes after a head's codes: its scale's exponent, then zeros
STORE_DTYPE = torch.uint8


def packed(head_dim: int) -> int:
    """Bytes of one KV head's cached row."""
    return head_dim + PAD


def is_fp8(rows: torch.Tensor) -> bool:
    """Whether a store (or a gathered run of its rows) holds FP8 packed rows."""
    return rows.dtype == STORE_DTYPE


def head_dim_of(rows: torch.Tensor) -> int:
    """The head_dim of a store's rows [..., KVH, width]: width itself, or width - PAD packed."""
    return rows.shape[-1] - PAD if is_fp8(rows) else rows.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] float -> uint8 [..., D + PAD]: each row's e4m3 codes and scale exponent."""
    x32 = x.float()
    scales = activation_scales(x32.abs().amax(dim=-1).reshape(-1)).view(x.shape[:-1])
    exponent = scales.view(torch.int32) >> 23
    inverse = ((254 - exponent) << 23).view(torch.float32)
    codes = (x32 * inverse[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    out = torch.zeros((*x.shape[:-1], packed(x.shape[-1])), dtype=STORE_DTYPE, device=x.device)
    out[..., :x.shape[-1]] = codes
    out[..., x.shape[-1]] = exponent.to(STORE_DTYPE)
    return out


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., D + PAD] -> [..., D] codes * scale in float32, then in `dtype` (exactly)."""
    d = rows.shape[-1] - PAD
    scale = (rows[..., d].to(torch.int32) << 23).view(torch.float32)
    return (rows[..., :d].contiguous().view(FP8).float() * scale[..., None]).to(dtype)


def values(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A store's rows as values: dequantized when packed FP8, else as they are."""
    return dequantize_rows(rows, dtype) if is_fp8(rows) else rows


def to_store(x: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
    """New rows x [..., D] in the store's form: quantized for a packed FP8 store, else cast."""
    return quantize_rows(x) if is_fp8(store) else x.to(store.dtype)
