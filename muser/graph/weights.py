"""Weights of the layer graph, already in the layout the ops want (fused QKV, fused gate+up)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from muser.config import ModelConfig
from muser.ops.blocks import Blocks, block_tensors
from muser.ops.fp8 import Fp8Matrix, cat_rows, quantize_fp8
from muser.ops.packed import PackedMatrix

Matrix = torch.Tensor | PackedMatrix | Fp8Matrix | Blocks  # packed: CPU float32 weights that
# keep their GGUF codes; fp8: GPU projections as e4m3 codes and per-row scales
# (--quantization fp8); blocks: GPU weights that keep the file's bytes
# (muser/ops/triton/block_weights.py)


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden] f32 (Gemma's 1 + w folded in)
    qkv: Matrix  # [q_size + 2 * kv_size, hidden]
    q_norm: torch.Tensor  # [head_dim] f32
    k_norm: torch.Tensor  # [head_dim] f32
    o_proj: Matrix  # [hidden, q_size]
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: Matrix  # [2 * intermediate, hidden], gate rows first
    down: Matrix  # [hidden, intermediate]
    post_ffn_norm: torch.Tensor


@dataclass(slots=True)
class ModelWeights:
    embed: Matrix  # [vocab, hidden]
    final_norm: torch.Tensor
    layers: list[LayerWeights]
    lm_head: Matrix | None = None  # None: tied to `embed`

    @property
    def dtype(self) -> torch.dtype:
        """The projections' dtype: norms hand them their input already rounded to it."""
        return self.layers[0].qkv.dtype

    @property
    def head(self) -> Matrix:
        """The LM head: `lm_head`, or the tied embedding."""
        return self.embed if self.lm_head is None else self.lm_head

    def nbytes(self) -> int:
        """Bytes held, each tensor once (a tied head shares the embedding's)."""
        tensors: dict[int, torch.Tensor] = {}
        mats = [self.embed, self.final_norm, self.head]
        for layer in self.layers:
            mats += [getattr(layer, name) for name in LayerWeights.__slots__]
        for m in mats:
            tensors.update((id(t), t) for t in matrix_tensors(m))
        return sum(t.nbytes for t in tensors.values())


def matrix_tensors(m: Matrix) -> list[torch.Tensor]:
    """The tensors that hold a matrix's bytes, whatever its kind."""
    parts = ([m.data, m.scales, m.mins] if isinstance(m, PackedMatrix) else
             [m.data, m.scales] if isinstance(m, Fp8Matrix) else
             block_tensors(m) if isinstance(m, Blocks) else [m])
    return [t for t in parts if t is not None]


HEAD_SLICE_ROWS = 16384  # head rows quantized at a time (bounds quantize_fp8's float32 copy)


def with_fp8_head(weights: ModelWeights) -> ModelWeights:
    """The weights with the LM head as FP8 (`quantize_fp8`: one scale per vocabulary row). A
    tied head is the embedding, so the lookup reads the same codes (`ops.embed`). Rows are
    quantized independently, so slices of HEAD_SLICE_ROWS quantize exactly as the whole."""
    head = weights.head
    if isinstance(head, Fp8Matrix):
        return weights
    if not isinstance(head, torch.Tensor):
        raise TypeError(f"an FP8 head is made from a dense head, not {type(head).__name__}")
    fp8 = cat_rows([quantize_fp8(head[r:r + HEAD_SLICE_ROWS])
                    for r in range(0, head.shape[0], HEAD_SLICE_ROWS)])
    if weights.lm_head is None:
        return dataclasses.replace(weights, embed=fp8)
    return dataclasses.replace(weights, lm_head=fp8)


def random_weights(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
    made_on: torch.device | str | None = None, fp8: bool = False,
) -> ModelWeights:
    """Seeded random weights of `cfg`'s shapes on `device` (no checkpoint needed), drawn by
    the generator of `made_on` (default: `device`; each device type draws its own values).
    `fp8`: each projection's `dtype` values quantized (quantize_fp8) as soon as it is drawn, so
    no more than one matrix is ever held wider; the embedding (the tied head) stays `dtype`."""
    made_on = made_on or device
    gen = torch.Generator(device=made_on).manual_seed(seed)

    def mat(rows: int, cols: int) -> Matrix:
        w = torch.randn(rows, cols, generator=gen, device=made_on, dtype=torch.float32)
        w = (w * cols**-0.5).to(device, dtype)
        return quantize_fp8(w) if fp8 else w

    def norm(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=gen, device=made_on)).to(device)

    h, i = cfg.hidden_size, cfg.intermediate_size
    layers = [
        LayerWeights(
            attn_norm=norm(h), qkv=mat(cfg.q_size + 2 * cfg.kv_size, h),
            q_norm=norm(cfg.head_dim), k_norm=norm(cfg.head_dim), o_proj=mat(h, cfg.q_size),
            post_attn_norm=norm(h), ffn_norm=norm(h), gate_up=mat(2 * i, h), down=mat(h, i),
            post_ffn_norm=norm(h),
        )
        for _ in range(cfg.num_layers)
    ]
    embed = (torch.randn(cfg.vocab_size, h, generator=gen, device=made_on) * 0.05).to(
        device, dtype)
    return ModelWeights(embed=embed, final_norm=norm(h), layers=layers)
