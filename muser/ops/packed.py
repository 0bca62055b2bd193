"""Block-quantized matrices kept as int8 codes for CPU decode.

A decode step reads every weight once, so its speed is memory traffic: the file's codes at one
byte per weight (plus a float32 scale, and for K-quants an offset, per 16 or 32 weights) read
about 3.5x less than float32. `codes * scales - mins` is exactly the float32 matrix the loader
dequantizes, which stays beside the codes for prefill GEMMs. The tied embedding / LM head
keeps no dense twin: embedding rows are dequantized on lookup and every product reads codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from muser.loading.quants import Codes


@dataclass(slots=True)
class PackedMatrix:
    dense: torch.Tensor | None  # [M, K] float32 for prefill GEMMs; None: not kept
    codes: torch.Tensor  # int8 [M, K]
    scales: torch.Tensor  # float32 [M, K // group]
    mins: torch.Tensor | None  # float32 [M, K // group]; None: no offsets
    group: int  # 16 or 32

    @classmethod
    def from_codes(cls, c: Codes, shape: tuple[int, int], dense: torch.Tensor | None
                   ) -> PackedMatrix:
        """Row-major block codes of a [M, K] tensor -> packed matrix (K a multiple of blocks)."""
        m, k = shape
        mins = None if c.mins is None else c.mins.reshape(m, -1).contiguous()
        return cls(dense, c.codes.reshape(m, k).contiguous(),
                   c.scales.reshape(m, -1).contiguous(), mins, c.group)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """codes * scales - mins of every row (or of `rows`): [M or len(rows), K] float32,
        equal to the loader's dense matrix bit for bit."""
        from muser.loading.quants import Codes  # NOTE: runtime import (loading imports us)

        codes, scales, mins = self.codes, self.scales, self.mins
        if rows is not None:
            codes, scales = codes[rows], scales[rows]
            mins = None if mins is None else mins[rows]
        return Codes(codes, scales, mins, self.group).dequantize()  # rows as blocks


def cat_rows(parts: list[PackedMatrix]) -> PackedMatrix:
    """Stack matrices along M (fused QKV, gate+up): groups meet at the smallest size, and a part
    without offsets gets zero ones when another has them."""
    group = min(p.group for p in parts)

    def regroup(t: torch.Tensor, p: PackedMatrix) -> torch.Tensor:
        return t.repeat_interleave(p.group // group, dim=1)

    scales = torch.cat([regroup(p.scales, p) for p in parts])
    mins = None
    if any(p.mins is not None for p in parts):
        mins = torch.cat([
            regroup(p.mins, p) if p.mins is not None else torch.zeros_like(regroup(p.scales, p))
            for p in parts
        ])
    dense = None if any(p.dense is None for p in parts) else torch.cat([p.dense for p in parts])
    return PackedMatrix(dense, torch.cat([p.codes for p in parts]),
                        scales, mins, group)


def dense(weight: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """The dense matrix of a weight, packed or not (dequantized when no twin is kept)."""
    if not isinstance(weight, PackedMatrix):
        return weight
    return weight.dense if weight.dense is not None else weight.dequantize()
