"""Matrices in the CPU kernels' layout: panels of 16 rows.

Element (m, k) of an [M, K] matrix sits at data[m // 16, k, m % 16] (the last panel padded
with zeros), so the kernel's vectors run across 16 output rows and each output is one FMA
chain along k (muser/ops/native/gemm.c). `data` is either

- the GGUF file's block codes (int8) with a float32 scale, and for K-quants an offset, per
  `group` columns: W = codes * scales - mins, exactly the float32 weights ggml's
  dequantization gives, at about a quarter of their bytes; or
- the values themselves, float32, float16 or bfloat16.

The CPU keeps nothing else: no dense twin, the embedding is looked up from the codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muser.ops.quants import Codes

PANEL = 16
VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _to_panels(t: torch.Tensor) -> torch.Tensor:
    """[M, C] -> [ceil(M / 16), C, 16], zero-padded."""
    m, c = t.shape
    panels = -(-m // PANEL)
    if panels * PANEL != m:
        t = torch.cat([t, t.new_zeros(panels * PANEL - m, c)])
    return t.view(panels, PANEL, c).transpose(1, 2).contiguous()


def _compact(scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """float32 scales as float16 when that holds every one exactly (and no offsets follow):
    half the scale bytes a decode step reads, the same values."""
    if mins is None:
        half = scales.to(torch.float16)
        if torch.equal(half.float(), scales):
            return half
    return scales


def _panel_rows(t: torch.Tensor, rows: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """Rows `rows` (or all) of a panelled [P, C, 16] tensor -> [n, C]."""
    if rows is None:
        return t.transpose(1, 2).reshape(-1, t.shape[1])[:num_rows]
    return t[rows // PANEL, :, rows % PANEL]


@dataclass(slots=True)
class PackedMatrix:
    data: torch.Tensor  # [panels, K, 16]: int8 codes, or float32 / float16 / bfloat16 values
    scales: torch.Tensor | None  # codes: [panels, K // group, 16] float32, or float16 when
    # every scale is a float16 value and there are no offsets (Q8_0, Q4_0, Q5_0); values: None
    mins: torch.Tensor | None  # like scales; None: no offsets
    group: int  # codes: columns per scale; values: 0
    rows: int  # M

    @classmethod
    def from_codes(cls, c: Codes, shape: tuple[int, int]) -> PackedMatrix:
        """Row-major block codes of an [M, K] tensor (K a multiple of its blocks)."""
        m, k = shape
        mins = None if c.mins is None else _to_panels(c.mins.reshape(m, -1))
        return cls(_to_panels(c.codes.reshape(m, k)),
                   _compact(_to_panels(c.scales.reshape(m, -1)), mins), mins, c.group, m)

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> PackedMatrix:
        """An [M, K] float32 / float16 / bfloat16 matrix, values kept in its dtype."""
        if w.dtype not in VALUE_DTYPES:
            raise TypeError(f"no CPU kernel for {w.dtype} weights")
        return cls(_to_panels(w.contiguous()), None, None, 0, w.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.data.shape[1]

    @property
    def is_codes(self) -> bool:
        return self.scales is not None

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: float32 for codes (their dequantized values)."""
        return torch.float32 if self.is_codes else self.data.dtype

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.data, self.scales, self.mins) if t is not None)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """W of every row (or of `rows`): [M or len(rows), K] float32, the values the kernel
        multiplies (codes * scales - mins: bit for bit the loader's dequantization)."""
        data = _panel_rows(self.data, rows, self.rows)
        if not self.is_codes:
            return data.float()
        scales = _panel_rows(self.scales, rows, self.rows).float()
        scales = scales.repeat_interleave(self.group, 1)
        w = scales * data.float()
        if self.mins is not None:
            w = w - _panel_rows(self.mins, rows, self.rows).repeat_interleave(self.group, 1)
        return w


def cat_rows(parts: list[PackedMatrix]) -> PackedMatrix:
    """Stack matrices along M (fused QKV, gate+up). Codes meet at the smallest group (a part
    without offsets gets zero ones when another has them); values keep their dtype."""
    if not all(p.is_codes for p in parts):
        if any(p.is_codes for p in parts) or len({p.dtype for p in parts}) > 1:
            raise TypeError("fused rows need one weight format")
        return PackedMatrix.from_dense(torch.cat([_panel_rows(p.data, None, p.rows)
                                                  for p in parts]))
    group = min(p.group for p in parts)

    def rows_of(t: torch.Tensor, p: PackedMatrix) -> torch.Tensor:
        return _panel_rows(t, None, p.rows).float().repeat_interleave(p.group // group, dim=1)

    codes = torch.cat([_panel_rows(p.data, None, p.rows) for p in parts])
    scales = torch.cat([rows_of(p.scales, p) for p in parts])
    mins = None
    if any(p.mins is not None for p in parts):
        mins = _to_panels(torch.cat([
            rows_of(p.mins, p) if p.mins is not None else torch.zeros_like(rows_of(p.scales, p))
            for p in parts]))
    return PackedMatrix(_to_panels(codes), _compact(_to_panels(scales), mins), mins, group,
                        codes.shape[0])


def dense(weight: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """The dense [M, K] matrix of a weight, packed or not (float32 when dequantized)."""
    if not isinstance(weight, PackedMatrix):
        return weight
    if weight.is_codes:
        return weight.dequantize()
    return _panel_rows(weight.data, None, weight.rows)
