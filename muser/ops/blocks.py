"""Matrices kept as their GGUF blocks on the device, for kernels that dequantize as they read
(muser/ops/triton/block_values.py): device memory stays at the file's size."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from muser.ops.quants import dequantize

# Block types whose fp16 d BlockMatrix keeps apart, and its byte offset in the file's block
D_AT = {GGMLQuantizationType.Q8_0: 0, GGMLQuantizationType.Q6_K: 208}
# The block types the Triton kernels read; the others stay CPU-only (or dequantized) for now.
KERNEL_TYPES = tuple(GGMLQuantizationType[name]
                     for name in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))


@dataclass(slots=True)
class BlockMatrix:
    """An [M, K] matrix as the file's bytes: row m is K // block_size consecutive blocks. Q8_0
    and Q6_K keep each block's fp16 d apart, in `d`, their other bytes in `data` (Q8_0: the
    int8 codes, K a row; Q6_K: 208 bytes a block): rows of 16-byte multiples, so the kernels
    load aligned words, which the 34- and 210-byte blocks are not."""

    data: torch.Tensor  # uint8 [M, K // block_size * type_size] (Q8_0, Q6_K: without the d)
    qtype: GGMLQuantizationType
    cols: int  # K
    dtype: torch.dtype = torch.float32  # the projection's input and output dtype (the engine's)
    d: torch.Tensor | None = None  # Q8_0, Q6_K: float16 [M, K // block_size]

    @classmethod
    def from_raw(cls, raw: torch.Tensor, qtype: GGMLQuantizationType,
                 shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> BlockMatrix:
        """raw: the tensor's bytes as stored (uint8, any shape) of an [M, K] matrix."""
        m, k = shape
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if k % block_size or raw.numel() != m * k // block_size * type_size:
            raise ValueError(f"{qtype.name} blocks of {raw.numel()} bytes cannot hold a "
                             f"{m} x {k} matrix")
        if qtype not in D_AT:
            return cls(raw.reshape(m, -1), qtype, k, dtype)
        at = D_AT[qtype]
        blocks = raw.reshape(m, k // block_size, type_size)
        body = torch.cat([blocks[..., :at], blocks[..., at + 2:]], dim=2)
        return cls(body.reshape(m, -1), qtype, k, dtype,
                   blocks[..., at:at + 2].contiguous().view(torch.float16).reshape(m, -1))

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    @property
    def device(self) -> torch.device:
        return self.data.device

    def rows(self, start: int, stop: int) -> BlockMatrix:
        """Rows start .. stop - 1 (a view: rows are independent runs of blocks)."""
        return self.take(slice(start, stop))

    def take(self, index) -> BlockMatrix:
        """The rows `index` selects (a slice, or row ids: a gather)."""
        return BlockMatrix(self.data[index], self.qtype, self.cols, self.dtype,
                           None if self.d is None else self.d[index])

    def clone(self) -> BlockMatrix:
        return BlockMatrix(self.data.clone(), self.qtype, self.cols, self.dtype,
                           None if self.d is None else self.d.clone())

    def file_bytes(self) -> torch.Tensor:
        """uint8 [M, row bytes]: the blocks as the file stores them."""
        if self.d is None:
            return self.data
        m, at = self.data.shape[0], D_AT[self.qtype]
        body = self.data.reshape(m, self.d.shape[1], -1)
        return torch.cat([body[..., :at], self.d.reshape(m, -1, 1).view(torch.uint8),
                          body[..., at:]], dim=2).reshape(m, -1)

    def dequantize(self) -> torch.Tensor:
        """[M, K] float32: gguf's dequantization, bit for bit (muser.ops.quants)."""
        return dequantize(self.file_bytes(), self.qtype, self.shape)


@dataclass(slots=True)
class BlockRows:
    """An [M, K] matrix stacked from row segments of different block types (fused QKV or
    gate+up of a mixed file, e.g. Q5_0 q and k over Q8_0 v): each segment stays the file's
    bytes and its kernel reads it in place."""

    parts: tuple[BlockMatrix, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].cols

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device


Blocks = BlockMatrix | BlockRows


def segments(weight: Blocks, start: int = 0, stop: int | None = None
             ) -> list[tuple[int, BlockMatrix]]:
    """(first row, single-type rows) covering rows start .. stop - 1 of `weight`."""
    stop = weight.shape[0] if stop is None else stop
    out, at = [], 0
    for part in weight.parts if isinstance(weight, BlockRows) else (weight,):
        lo, hi = max(start, at), min(stop, at + part.shape[0])
        if lo < hi:
            out.append((lo, part.rows(lo - at, hi - at)))
        at += part.shape[0]
    return out


def cat_blocks(parts: list[BlockMatrix]) -> Blocks:
    """Stack matrices along M. GGUF rows are independent, so the bytes of consecutive parts of
    one block type concatenate: one BlockMatrix when every part shares the type, else
    BlockRows of one segment per run of a type (a Q4_K_M QKV of Q5_0 q, k and Q8_0 v: two)."""
    if len({(p.cols, p.dtype) for p in parts}) > 1:
        raise ValueError("fused rows need one width and one dtype")
    runs = [list(run) for _, run in groupby(parts, key=lambda p: p.qtype)]
    merged = [BlockMatrix(torch.cat([p.data for p in run]), run[0].qtype, run[0].cols,
                          run[0].dtype, None if run[0].d is None else torch.cat([p.d for p in run]))
              for run in runs]
    return merged[0] if len(merged) == 1 else BlockRows(tuple(merged))


def block_tensors(weight: Blocks) -> list[torch.Tensor]:
    """The tensors that hold `weight`'s bytes."""
    parts = weight.parts if isinstance(weight, BlockRows) else (weight,)
    return [t for p in parts for t in (p.data, p.d) if t is not None]
