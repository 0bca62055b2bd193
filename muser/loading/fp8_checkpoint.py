"""Pre-quantized FP8 Hugging Face checkpoints: config.json's quantization_config, and each
quantized projection's `<name>.weight` (float8_e4m3fn [M, K]) with its `<name>.weight_scale`
read into an Fp8Matrix (muser/ops/fp8.py). In both layouts the scale is the dequantization
scale: W = weight * weight_scale (multiplied, not divided).

- `compressed-tensors` (llm-compressor's FP8 schemes; format float-quantized): weight_scale is
  [M, 1] (strategy "channel"), [1] or [] ("tensor": broadcast to every row, exactly), or
  [ceil(M / bm), ceil(K / bk)] ("block", block_structure [bm, bk]: read as float32 values,
  which --quantization fp8 requantizes per row, because the kernels take per-row scales: a
  second rounding, of at most 2^-4 relative). A static `input_scale` is not used: activations
  are quantized per token at run time (or not at all), whichever measured faster.
- `fbgemm_fp8`: weight_scale [M, 1] float32; `input_scale_ub` (the activation clamp) is not
  used, for the same reason.

Modules the checkpoint left unquantized (its ignore / modules_to_not_convert: lm_head
typically) are plain tensors and load as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from muser.errors import ModelLoadError
from muser.ops.fp8 import FP8, Fp8Matrix

METHODS = ("compressed-tensors", "fbgemm_fp8")
_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True, slots=True)
class Fp8Layout:
    method: str  # one of METHODS
    block: tuple[int, int] | None = None  # compressed-tensors "block" strategy: [bm, bk]


def fp8_layout(config: dict[str, Any]) -> Fp8Layout | None:
    """config.json's quantization_config -> its FP8 layout (None: not quantized), or
    ModelLoadError naming what is not supported."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "fbgemm_fp8":
        return Fp8Layout(method)
    if method != "compressed-tensors":
        raise ModelLoadError(f"config.json: quantization_config quant_method {method!r} is "
                             f"not supported (supported: {', '.join(METHODS)}, FP8 e4m3)")
    if q.get("format") not in _FORMATS:
        raise ModelLoadError(f"config.json: compressed-tensors format {q.get('format')!r} is "
                             f"not supported (supported: {', '.join(_FORMATS)}, FP8 e4m3)")
    blocks = set()
    for name, group in (q.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ModelLoadError(f"config.json: compressed-tensors group {name!r} quantizes "
                                 f"weights to {weights.get('num_bits')}-bit "
                                 f"{weights.get('type')}; muser loads 8-bit float (FP8)")
        if weights.get("strategy") == "block":
            blocks.add(tuple(weights.get("block_structure") or (128, 128)))
    if len(blocks) > 1:
        raise ModelLoadError(f"config.json: compressed-tensors groups use blocks {sorted(blocks)}; "
                             f"muser loads one block shape")
    return Fp8Layout(method, blocks.pop() if blocks else None)


def read_fp8(data: torch.Tensor, scale: torch.Tensor | None, name: str, layout: Fp8Layout,
             dtype: torch.dtype, device: torch.device | str) -> Fp8Matrix | torch.Tensor:
    """`name` (an [M, K] float8_e4m3fn weight) and its weight_scale (None: missing), on
    `device` -> an Fp8Matrix when the scales are per row or per tensor (`dtype`: the
    projection's), else (per block) the float32 values data * scale."""
    if data.dtype != FP8:
        raise ModelLoadError(f"tensor '{name}' is {data.dtype}; FP8 checkpoints hold "
                             f"float8_e4m3fn weights")
    base = name.removesuffix("weight")
    if scale is None:
        raise ModelLoadError(f"checkpoint lacks tensor '{base}weight_scale' (the scale of FP8 "
                             f"weight '{name}')")
    m, k = data.shape
    shape = tuple(scale.shape)
    data, scale = data.to(device), scale.to(device, torch.float32)
    if shape in ((m, 1), (m,)):
        return Fp8Matrix(data, scale.reshape(m).contiguous(), dtype)
    if scale.numel() == 1 and len(shape) <= 1:
        return Fp8Matrix(data, scale.reshape(1).expand(m).contiguous(), dtype)
    if layout.block is not None:
        bm, bk = layout.block
        if shape == (-(-m // bm), -(-k // bk)):
            per_weight = scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
            return data.float() * per_weight
    blocks = f", or blocks of {list(layout.block)}" if layout.block else ""
    raise ModelLoadError(f"tensor '{base}weight_scale' has shape {list(shape)}; the FP8 "
                         f"weight {[m, k]} takes [{m}, 1] (per row) or [1] (per tensor){blocks}")
