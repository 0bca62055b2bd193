"""FP8 weights (`--quantization fp8`): an [M, K] matrix as float8 e4m3 codes and one float32
scale per output row, W[m, k] = data[m, k] * scales[m].

Why per output channel: a decode GEMV reads whole rows, so a row's one scale is applied once
to its finished sum (y[n, m] = scales[m] * sum_k x[n, k] * data[m, k]: no multiply per weight),
and it is exactly `torch._scaled_mm`'s rowwise scaling of the second operand (scale_b [1, M]).
Fused rows (QKV, gate + up) concatenate exactly, each part keeping its own scales. A
checkpoint's per-tensor scales broadcast to rows exactly; per-block scales (e.g. 128 x 128) are
requantized per row at load (muser/loading/fp8_checkpoint.py).

e4m3 ("fn": no infinities, NaN only at 0x7f/0xff) holds magnitudes up to 448 with 3 mantissa
bits: a row is scaled so its largest |w| lands on 448, then each w / scale rounds to nearest
(ties to even), so |w - dequantized| <= 2^-4 |w| down to 2^-6 * scale, and <= 2^-10 * scale
among the subnormals below it (tests/test_fp8.py derives it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muser.errors import MuserError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_MIN = torch.finfo(torch.float32).tiny  # a zero row's scale
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: FP8 tensor cores


@dataclass(slots=True)
class Fp8Matrix:
    data: torch.Tensor  # [M, K] float8_e4m3fn, row-major
    scales: torch.Tensor  # [M] float32: row m's values are data[m] * scales[m]
    dtype: torch.dtype  # the projection's input and output dtype (the model's, e.g. bfloat16)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes

    def to(self, device: torch.device | str) -> Fp8Matrix:
        return Fp8Matrix(self.data.to(device), self.scales.to(device), self.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """[M, K] (or the given rows) data * scales in float32, rounded once to `dtype`."""
        data, scales = (self.data, self.scales) if rows is None else (self.data[rows],
                                                                      self.scales[rows])
        return (data.float() * scales[:, None]).to(dtype)


def quantize_fp8(w: torch.Tensor, dtype: torch.dtype | None = None) -> Fp8Matrix:
    """An [M, K] float matrix -> Fp8Matrix of the same values to e4m3 precision (computed on
    w's device, in float32); `dtype`: the projection's dtype (default w.dtype). A zero row
    gets the smallest normal float32 scale and zero codes."""
    w32 = w.float()
    amax = w32.abs().amax(dim=1)
    # NOTE: a divisor tensor, not the Python number: CUDA torch turns division by a scalar into
    # multiplication by its reciprocal (not correctly rounded: an ulp off the CPU's on some rows)
    scales = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(SCALE_MIN)
    data = (w32 / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Matrix(data, scales, dtype or w.dtype)


def scaled_mm_fits(weight_dtype: torch.dtype, m: int, k: int) -> bool:
    """Whether cuBLAS's rowwise-scaled FP8 GEMM (`torch._scaled_mm`) takes this weight: it
    writes bfloat16 only and takes K and M in multiples of 16."""
    return weight_dtype == torch.bfloat16 and m % 16 == 0 and k % 16 == 0


def chunk_route(weight_dtype: torch.dtype, m: int, k: int) -> str:
    """How an FP8 projection of more than MAX_ROWS rows runs: "scaled_mm" (FP8 tensor cores)
    where it fits, else "dequant" (the weight dequantized, then a GEMM in its dtype)."""
    return "scaled_mm" if scaled_mm_fits(weight_dtype, m, k) else "dequant"


def activation_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per-row activation scales from rows' largest |x| (float32 [N]): the smallest power of two
    p with amax <= 448 p (at least SCALE_MIN), exactly, in integer arithmetic on the bits (amax
    = m 2^E with m in [1, 2): p = 2^(E - 8), or 2^(E - 7) when m > 1.75 = 448 / 2^8). Dividing
    by a power of two is exact, so the codes are x's own e4m3 roundings (no division per value
    to round first; a scale of exactly amax / 448 needs one); the row's largest lands in
    (224, 448], which costs e4m3's relative precision (3 bits at every normal magnitude)
    nothing."""
    bits = amax.float().view(torch.int32)
    e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return (e.clamp(min=1) << 23).view(torch.float32)


def quantize_activations(x: torch.Tensor) -> Fp8Matrix:
    """Activations [N, K] -> Fp8Matrix of their rows with `activation_scales`: each value times
    the exact 1 / scale, rounded to nearest e4m3 (ties to even). The specification of the FP8
    prefill route's activation quantization (muser/ops/triton/quantize_fp8.py); weights keep
    quantize_fp8's scales of exactly amax / 448."""
    x32 = x.float()
    scales = activation_scales(x32.abs().amax(dim=1))
    inverse = ((254 - (scales.view(torch.int32) >> 23)) << 23).view(torch.float32)
    data = (x32 * inverse[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Matrix(data, scales, x.dtype)


def attach_rows(x: torch.Tensor, rows: Fp8Matrix) -> None:
    """Hang on activations x [N, K] their rows quantized per token (`quantize_activations(x)`
    bit for bit), made by the kernel that wrote x, for the FP8 projection that reads x next
    (no quantization kernel of its own). They belong to this tensor object: a view, slice or
    copy of x carries none, and nothing writes x in place."""
    x.fp8_rows = rows


def attached_rows(x: torch.Tensor) -> Fp8Matrix | None:
    """The quantized rows `attach_rows` hung on x, if any."""
    return getattr(x, "fp8_rows", None)


def cat_rows(parts: list[Fp8Matrix]) -> Fp8Matrix:
    """Stack matrices along M (fused QKV, gate + up): exact, each row keeps its scale."""
    if len({p.dtype for p in parts}) > 1:
        raise TypeError("fused rows need one dtype")
    return Fp8Matrix(torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]),
                     parts[0].dtype)


def require_fp8_device(device: torch.device | str) -> None:
    """MuserError unless `device` is a CUDA GPU with FP8 tensor cores (no silent fallback)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise MuserError("--quantization fp8 runs on a CUDA GPU of compute capability >= 8.9 "
                         "(Ada, Hopper); the CPU backend has no FP8 kernels")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise MuserError(f"--quantization fp8 needs compute capability >= 8.9 (FP8 tensor "
                         f"cores); {torch.cuda.get_device_name(device)} is "
                         f"{capability[0]}.{capability[1]}")
