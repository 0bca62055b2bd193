"""GGUF tensor dequantization in torch: ggml's bit layouts, float32 math, CPU or CUDA.

Every kernel reproduces ggml's (and gguf-py's) arithmetic order in float32, e.g. for Q4_K
`(d * sc) * q - (dmin * m)`, so results match `gguf.quants.dequantize` bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QT = GGMLQuantizationType
QK_K = 256
K_SCALE_SIZE = 12


class UnsupportedQuantization(ValueError):
    """A GGUF tensor type this module cannot dequantize."""


def _f16(cols: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian fp16 bytes -> [n, 1] float32."""
    return cols.contiguous().view(torch.float16).float()


def _shifts(values: range | tuple[int, ...], like: torch.Tensor, *view: int) -> torch.Tensor:
    """Shift amounts as a uint8 tensor on `like`'s device, viewed as `view`."""
    return torch.tensor(tuple(values), dtype=torch.uint8, device=like.device).view(*view)


def _low_high_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, g, w] bytes -> [n, 2g, w]: per w-byte group, low nibbles then high nibbles."""
    n, g, w = qs.shape
    q = qs.unsqueeze(2) >> _shifts((0, 4), qs, 1, 1, 2, 1)
    return (q & 0x0F).reshape(n, 2 * g, w)


def _reinterpret(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Flat bytes viewed as `dtype`, copied first if the offset is misaligned for it."""
    flat = blocks.reshape(-1)
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    """F32: bytes reinterpreted (shares memory with `raw`)."""
    return _reinterpret(blocks, torch.float32)


def _f16_tensor(blocks: torch.Tensor) -> torch.Tensor:
    """F16: widened to float32 (exact)."""
    return _reinterpret(blocks, torch.float16).float()


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    """BF16: widened to float32 (exact)."""
    return _reinterpret(blocks, torch.bfloat16).float()


@dataclass(slots=True)
class Codes:
    """A block-quantized tensor as integer codes and per-group affine terms, in block order:
    x = scales * codes - mins, `group` consecutive values sharing one scale (and min)."""

    codes: torch.Tensor  # int8 [n_blocks, block_size]
    scales: torch.Tensor  # float32 [n_blocks, block_size // group]
    mins: torch.Tensor | None  # like scales; None: no offset
    group: int

    def dequantize(self) -> torch.Tensor:
        """[n_blocks, block_size] float32: scales * codes - mins (ggml's order and rounding)."""
        n, size = self.codes.shape
        x = self.scales.unsqueeze(-1) * self.codes.view(n, -1, self.group).float()
        if self.mins is not None:
            x = x - self.mins.unsqueeze(-1)
        return x.reshape(n, size)


def _i8(q: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Unsigned small codes (uint8) minus `offset` -> int8."""
    return (q.to(torch.int16) - offset).to(torch.int8)


def _q8_0(blocks: torch.Tensor) -> Codes:
    """Q8_0: fp16 d, 32 int8 q; x = d * q."""
    return Codes(blocks[:, 2:].view(torch.int8), _f16(blocks[:, :2]), None, 32)


def _q4_0(blocks: torch.Tensor) -> Codes:
    """Q4_0: fp16 d, 16 bytes of nibbles; x = d * (q - 8)."""
    q = _low_high_nibbles(blocks[:, 2:].unsqueeze(1)).reshape(-1, 32)
    return Codes(_i8(q, 8), _f16(blocks[:, :2]), None, 32)


def _q5_0(blocks: torch.Tensor) -> Codes:
    """Q5_0: fp16 d, 32 high bits (u32 LE), 16 bytes of nibbles; x = d * (q - 16)."""
    qh = (blocks[:, 2:6].unsqueeze(-1) >> _shifts(range(8), blocks, 1, 1, 8)) & 1
    ql = _low_high_nibbles(blocks[:, 6:].unsqueeze(1)).reshape(-1, 32)
    return Codes(_i8(ql | (qh.reshape(-1, 32) << 4), 16), _f16(blocks[:, :2]), None, 32)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] packed 6-bit scales/mins (get_scale_min_k4) -> two [n, 8] uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> Codes:
    """Q4_K/Q5_K tail: x = (d * sc) * q - (dmin * m) over 8 sub-blocks of 32."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4 : 4 + K_SCALE_SIZE])
    return Codes(_i8(q.reshape(-1, QK_K)), d * sc.float(), dmin * mn.float(), 32)


def _q4_k(blocks: torch.Tensor) -> Codes:
    """Q4_K: fp16 d, fp16 dmin, 12 bytes scales/mins, 128 bytes of nibbles."""
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    return _k_affine(blocks, _low_high_nibbles(qs))


def _q5_k(blocks: torch.Tensor) -> Codes:
    """Q5_K: as Q4_K with 32 bytes of high bits (bit i of qh[l] for sub-block i) before qs."""
    qh = blocks[:, 16:48].unsqueeze(1) >> _shifts(range(8), blocks, 1, 8, 1)
    ql = _low_high_nibbles(blocks[:, 48:].reshape(-1, 4, 32))
    return _k_affine(blocks, ql | ((qh & 1) << 4))


def _q6_k(blocks: torch.Tensor) -> Codes:
    """Q6_K: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, fp16 d;
    x = (d * sc) * (q - 32) over 16 groups of 16."""
    n = blocks.shape[0]
    ql = _low_high_nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), blocks, 1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    scales = blocks[:, 192:208].view(torch.int8).float()
    return Codes(_i8((ql | (qh << 4)).reshape(n, QK_K), 32), _f16(blocks[:, 208:210]) * scales,
                 None, 16)


_FLOATS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    QT.F32: _f32,
    QT.F16: _f16_tensor,
    QT.BF16: _bf16,
}
_CODES: dict[GGMLQuantizationType, Callable[[torch.Tensor], Codes]] = {
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
    QT.Q5_0: _q5_0,
    QT.Q4_K: _q4_k,
    QT.Q5_K: _q5_k,
    QT.Q6_K: _q6_k,
}

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(_FLOATS) | frozenset(_CODES)


def _qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    """`qtype` as the enum, or UnsupportedQuantization for an unknown id."""
    try:
        return GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedQuantization(f"unknown GGUF tensor type id {qtype!r}") from None


def _blocks(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """raw bytes -> [n_blocks, type_size] uint8, checked against `shape`."""
    if qtype not in SUPPORTED:
        have = ", ".join(sorted(t.name for t in SUPPORTED))
        raise UnsupportedQuantization(f"cannot dequantize GGUF type {qtype.name} (have: {have})")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = math.prod(shape)
    data = raw.reshape(-1).view(torch.uint8)
    if numel % block_size or data.numel() != numel // block_size * type_size:
        raise ValueError(
            f"{qtype.name} tensor of shape {tuple(shape)} needs "
            f"{numel // block_size * type_size} bytes, got {data.numel()}"
        )
    return data.view(-1, type_size)


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """raw: the tensor's bytes as stored (uint8, any shape) -> float32 tensor of torch `shape`."""
    qtype = _qtype(qtype)
    blocks = _blocks(raw, qtype, shape)
    if qtype in _FLOATS:
        return _FLOATS[qtype](blocks).reshape(shape)
    return _CODES[qtype](blocks).dequantize().reshape(shape)


def codes(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> Codes | None:
    """The block codes of a quantized tensor (None for F32/F16/BF16), blocks in row order."""
    qtype = _qtype(qtype)
    blocks = _blocks(raw, qtype, shape)
    return _CODES[qtype](blocks) if qtype in _CODES else None
