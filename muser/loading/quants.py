"""GGUF tensor dequantization in torch: ggml's bit layouts, float32 math, CPU or CUDA.

Every kernel reproduces ggml's (and gguf-py's) arithmetic order in float32, e.g. for Q4_K
`(d * sc) * q - (dmin * m)`, so results match `gguf.quants.dequantize` bit for bit.
"""

from __future__ import annotations

import math
from typing import Callable

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


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0: fp16 d, 32 int8 q; x = q * d."""
    d = _f16(blocks[:, :2])
    return blocks[:, 2:].view(torch.int8).float().mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0: fp16 d, 16 bytes of nibbles; x = d * (q - 8)."""
    d = _f16(blocks[:, :2])
    q = _low_high_nibbles(blocks[:, 2:].unsqueeze(1)).reshape(-1, 32)
    return d * (q.float() - 8.0)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0: fp16 d, 32 high bits (u32 LE), 16 bytes of nibbles; x = d * (q - 16)."""
    d = _f16(blocks[:, :2])
    qh = (blocks[:, 2:6].unsqueeze(-1) >> _shifts(range(8), blocks, 1, 1, 8)) & 1
    ql = _low_high_nibbles(blocks[:, 6:].unsqueeze(1)).reshape(-1, 32)
    q = ql | (qh.reshape(-1, 32) << 4)
    return d * (q.float() - 16.0)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] packed 6-bit scales/mins (get_scale_min_k4) -> two [n, 8] uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K tail: (d * sc) * q - (dmin * m) over 8 sub-blocks of 32."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4 : 4 + K_SCALE_SIZE])
    dl = (d * sc.float()).unsqueeze(-1)
    ml = (dmin * mn.float()).unsqueeze(-1)
    return (dl * q.float() - ml).reshape(-1, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K: fp16 d, fp16 dmin, 12 bytes scales/mins, 128 bytes of nibbles."""
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    return _k_affine(blocks, _low_high_nibbles(qs))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K: as Q4_K with 32 bytes of high bits (bit i of qh[l] for sub-block i) before qs."""
    qh = blocks[:, 16:48].unsqueeze(1) >> _shifts(range(8), blocks, 1, 8, 1)
    ql = _low_high_nibbles(blocks[:, 48:].reshape(-1, 4, 32))
    return _k_affine(blocks, ql | ((qh & 1) << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, fp16 d."""
    n = blocks.shape[0]
    ql = _low_high_nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), blocks, 1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = (ql | (qh << 4)).reshape(n, 16, 16).float() - 32.0
    scales = blocks[:, 192:208].view(torch.int8).float()
    dl = (_f16(blocks[:, 208:210]) * scales).unsqueeze(-1)
    return (dl * q).reshape(n, QK_K)


_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    QT.F32: _f32,
    QT.F16: _f16_tensor,
    QT.BF16: _bf16,
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
    QT.Q5_0: _q5_0,
    QT.Q4_K: _q4_k,
    QT.Q5_K: _q5_k,
    QT.Q6_K: _q6_k,
}

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(_KERNELS)


def _qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    """`qtype` as the enum, or UnsupportedQuantization for an unknown id."""
    try:
        return GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedQuantization(f"unknown GGUF tensor type id {qtype!r}") from None


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """raw: the tensor's bytes as stored (uint8, any shape) -> float32 tensor of torch `shape`."""
    qtype = _qtype(qtype)
    if (kernel := _KERNELS.get(qtype)) is None:
        have = ", ".join(sorted(t.name for t in _KERNELS))
        raise UnsupportedQuantization(f"cannot dequantize GGUF type {qtype.name} (have: {have})")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = math.prod(shape)
    data = raw.reshape(-1).view(torch.uint8)
    if numel % block_size or data.numel() != numel // block_size * type_size:
        raise ValueError(
            f"{qtype.name} tensor of shape {tuple(shape)} needs "
            f"{numel // block_size * type_size} bytes, got {data.numel()}"
        )
    return kernel(data.view(-1, type_size)).reshape(shape)
