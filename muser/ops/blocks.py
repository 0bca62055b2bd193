"""Matrices kept as their GGUF blocks on the device, for kernels that dequantize as they read
(muser/ops/triton/block_values.py): device memory stays at the file's size."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from muser.loading.quants import dequantize

# The block types the Triton kernels read; the others stay CPU-only (or dequantized) for now.
KERNEL_TYPES = (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0,
                GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)


@dataclass(slots=True)
class BlockMatrix:
    """An [M, K] matrix as the file's bytes: row m is K // block_size consecutive blocks."""

    data: torch.Tensor  # uint8 [M, K // block_size * type_size]
    qtype: GGMLQuantizationType
    cols: int  # K

    @classmethod
    def from_raw(cls, raw: torch.Tensor, qtype: GGMLQuantizationType,
                 shape: tuple[int, int]) -> BlockMatrix:
        """raw: the tensor's bytes as stored (uint8, any shape) of an [M, K] matrix."""
        m, k = shape
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if k % block_size or raw.numel() != m * k // block_size * type_size:
            raise ValueError(f"{qtype.name} blocks of {raw.numel()} bytes cannot hold a "
                             f"{m} x {k} matrix")
        return cls(raw.reshape(m, -1), qtype, k)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def dequantize(self) -> torch.Tensor:
        """[M, K] float32: gguf's dequantization, bit for bit (muser.loading.quants)."""
        return dequantize(self.data, self.qtype, self.shape)
