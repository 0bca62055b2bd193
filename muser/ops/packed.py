"""Matrices in the CPU kernels' layout: panels of 16 rows.

Element (m, k) of an [M, K] matrix sits at data[m // 16, k, m % 16] (the last panel padded
with zeros), so the kernel's vectors run across 16 output rows and each output is one FMA
chain along k (muser/ops/native/gemm.c). `data` is either

- the GGUF file's block codes with a float32 scale, and for K-quants an offset, per `group`
  columns: W = codes * scales - mins, exactly the float32 weights ggml's dequantization
  gives. Codes are held at the width their values need: 4 bits for 0 .. 15 with offsets
  (Q4_K), 5 bits for -16 .. 15 with float16 scales (Q5_0), else int8 (`bits`; the layouts are
  gemm.c's), the kernel unpacking them in registers to the same integers; or
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


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 panels [P, K, 16] -> gemm.c's bytes for `bits` (8: the codes as they are)."""
    if bits == 8:
        return codes
    p, k, _ = codes.shape
    if bits == 4:  # byte (p, j, r) = code(2j) | code(2j + 1) << 4
        u = codes.to(torch.uint8).view(p, k // 2, 2, PANEL)
        return u[:, :, 0] | (u[:, :, 1] << 4)
    u = (codes + 16).to(torch.uint8).view(p, k // 8, 8, PANEL)  # 5 bits: 80 bytes per 8 k
    low = (u & 15).view(p, k // 8, 4, 2, PANEL)
    nibbles = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(p, k // 8, 4 * PANEL)
    high = torch.zeros(p, k // 8, PANEL, dtype=torch.uint8)
    for i in range(8):
        high |= ((u[:, :, i] >> 4) & 1) << i
    return torch.cat([nibbles, high], dim=2)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """_pack's inverse -> int8 panels [P, K, 16]."""
    if bits == 8:
        return data
    p = data.shape[0]
    if bits == 4:
        return torch.stack([data & 15, data >> 4], dim=2).view(p, -1, PANEL).to(torch.int8)
    nibbles = data[:, :, :4 * PANEL].reshape(p, -1, 4, PANEL)
    low = torch.stack([nibbles & 15, nibbles >> 4], dim=3).view(p, -1, 8, PANEL)
    high = torch.stack([(data[:, :, 4 * PANEL:] >> i) & 1 for i in range(8)], dim=2)
    return ((low | (high << 4)).to(torch.int8) - 16).view(p, -1, PANEL)


def _bits(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
          group: int) -> int:
    """The width gemm.c holds these codes at: 4 (0 .. 15, float32 scales and offsets), 5
    (-16 .. 15, float16 scales, no offsets), else 8."""
    lo, hi = int(codes.min()), int(codes.max())
    if mins is not None and scales.dtype == torch.float32 and 0 <= lo and hi <= 15:
        return 4 if group % 8 == 0 else 8
    if mins is None and scales.dtype == torch.float16 and -16 <= lo and hi <= 15:
        return 5 if group % 8 == 0 else 8
    return 8


def _codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
           rows: int) -> PackedMatrix:
    """A PackedMatrix of int8 code panels [P, K, 16], held at the width they need."""
    bits = _bits(codes, scales, mins, group)
    return PackedMatrix(_pack(codes, bits), scales, mins, group, rows, bits)


def _panel_rows(t: torch.Tensor, rows: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """Rows `rows` (or all) of a panelled [P, C, 16] tensor -> [n, C]."""
    if rows is None:
        return t.transpose(1, 2).reshape(-1, t.shape[1])[:num_rows]
    return t[rows // PANEL, :, rows % PANEL]


@dataclass(slots=True)
class PackedMatrix:
    data: torch.Tensor  # [panels, K, 16]: int8 codes, or float32 / float16 / bfloat16 values;
    # uint8 for codes of 4 bits [panels, K // 2, 16] or 5 bits [panels, K // 8, 80] (_pack)
    scales: torch.Tensor | None  # codes: [panels, K // group, 16] float32, or float16 when
    # every scale is a float16 value and there are no offsets (Q8_0, Q4_0, Q5_0); values: None
    mins: torch.Tensor | None  # like scales; None: no offsets
    group: int  # codes: columns per scale; values: 0
    rows: int  # M
    bits: int = 8  # codes: the width they are held at (4, 5 or 8)

    @classmethod
    def from_codes(cls, c: Codes, shape: tuple[int, int]) -> PackedMatrix:
        """Row-major block codes of an [M, K] tensor (K a multiple of its blocks)."""
        m, k = shape
        mins = None if c.mins is None else _to_panels(c.mins.reshape(m, -1))
        return _codes(_to_panels(c.codes.reshape(m, k)),
                      _compact(_to_panels(c.scales.reshape(m, -1)), mins), mins, c.group, m)

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> PackedMatrix:
        """An [M, K] float32 / float16 / bfloat16 matrix, values kept in its dtype."""
        if w.dtype not in VALUE_DTYPES:
            raise TypeError(f"no CPU kernel for {w.dtype} weights")
        return cls(_to_panels(w.contiguous()), None, None, 0, w.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        if self.bits == 8:
            return self.rows, self.data.shape[1]
        return self.rows, self.data.shape[1] * (2 if self.bits == 4 else 8)

    def codes(self) -> torch.Tensor:
        """The codes as int8 panels [panels, K, 16] (unpacked when held narrower)."""
        return _unpack(self.data, self.bits)

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
        if not self.is_codes:
            return _panel_rows(self.data, rows, self.rows).float()
        data = _panel_rows(self.codes(), rows, self.rows)
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

    codes = torch.cat([_panel_rows(p.codes(), None, p.rows) for p in parts])
    scales = torch.cat([rows_of(p.scales, p) for p in parts])
    mins = None
    if any(p.mins is not None for p in parts):
        mins = _to_panels(torch.cat([
            rows_of(p.mins, p) if p.mins is not None else torch.zeros_like(rows_of(p.scales, p))
            for p in parts]))
    return _codes(_to_panels(codes), _compact(_to_panels(scales), mins), mins, group,
                  codes.shape[0])


def dense(weight: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """The dense [M, K] matrix of a weight, packed or not (float32 when dequantized)."""
    if not isinstance(weight, PackedMatrix):
        return weight
    if weight.is_codes:
        return weight.dequantize()
    return _panel_rows(weight.data, None, weight.rows)
