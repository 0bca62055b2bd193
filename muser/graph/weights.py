"""Weights of the layer graph, already in the layout the ops want (fused QKV, fused gate+up)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
class MoeWeights:
    """A layer's mixture of experts (Gemma 4 26B-A4B), beside its dense MLP."""

    router: Matrix  # [num_experts, hidden]: expert scores of the normed residual
    router_scale: torch.Tensor  # [hidden] f32: the router's input gain
    expert_scale: torch.Tensor  # [num_experts] f32: each expert's output times it
    gate_up: list[Matrix]  # per expert [2 * moe_intermediate, hidden], gate rows first
    down: list[Matrix]  # per expert [hidden, moe_intermediate]
    pre_norm: torch.Tensor  # [hidden] f32: the experts' input norm
    post_norm: torch.Tensor  # [hidden] f32: after the experts' weighted sum
    post_dense_norm: torch.Tensor  # [hidden] f32: after the dense MLP, before the two add

    def parts(self) -> dict[str, Matrix]:
        """Every part by name: its field, 'gate_up.3' for expert 3's gate_up."""
        out: dict[str, Matrix] = {}
        for f in self.__slots__:
            v = getattr(self, f)
            out.update({f"{f}.{e}": m for e, m in enumerate(v)} if isinstance(v, list) else
                       {f: v})
        return out

    def map(self, fn: Callable[[Matrix], Matrix]) -> MoeWeights:
        """The experts with `fn` applied to each of their parts."""
        return MoeWeights(**{f: [fn(m) for m in v] if isinstance(v, list) else fn(v)
                             for f in self.__slots__ if (v := getattr(self, f)) is not None})


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden] f32 (Gemma's 1 + w folded in)
    qkv: Matrix  # [q_size + 2 * kv_size, hidden]
    q_norm: torch.Tensor  # [head_dim] f32
    k_norm: torch.Tensor | None  # [head_dim] f32 (None on a KV-sharing layer: no keys)
    o_proj: Matrix  # [hidden, q_size]
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: Matrix  # [2 * intermediate, hidden], gate rows first
    down: Matrix  # [hidden, intermediate]
    post_ffn_norm: torch.Tensor
    # Gemma 4 (None where the model has no such part). qkv then holds q and k only on a K=V
    # kind, q only on a KV-sharing layer.
    v_norm: torch.Tensor | None = None  # [head_dim] ones: values normalized without a gain
    per_layer_gate: Matrix | None = None  # PLE: [per_layer_input_size, hidden]
    per_layer_proj: Matrix | None = None  # PLE: [hidden, per_layer_input_size]
    per_layer_norm: torch.Tensor | None = None  # PLE: [hidden], after per_layer_proj
    layer_scalar: torch.Tensor | None = None  # [1]: the layer's output residual times it
    moe: MoeWeights | None = None  # the routed experts beside the MLP (None: a dense layer)

    def parts(self) -> dict[str, Matrix]:
        """Every part the layer has, by field (the parts its model lacks, None, left out); the
        experts' as 'moe.<their name>' (MoeWeights.parts)."""
        own = {f: v for f, v in self._own().items() if f != "moe"}
        experts = {} if self.moe is None else {f"moe.{k}": v for k, v in self.moe.parts().items()}
        return own | experts

    def map(self, fn: Callable[[Matrix], Matrix]) -> LayerWeights:
        """The layer with `fn` applied to each of its parts (e.g. moved to a device)."""
        return LayerWeights(**{f: v.map(fn) if f == "moe" else fn(v)
                               for f, v in self._own().items()})

    def _own(self) -> dict[str, object]:
        return {f: v for f in self.__slots__ if (v := getattr(self, f)) is not None}


@dataclass(slots=True)
class ModelWeights:
    embed: Matrix  # [vocab, hidden]
    final_norm: torch.Tensor
    layers: list[LayerWeights]
    lm_head: Matrix | None = None  # None: tied to `embed`
    # Gemma 4's per-layer inputs (PLE; None without): a token's row of per_layer_embed
    # [per_layer_vocab, layers * size] and per_layer_model_proj [layers * size, hidden] of its
    # embedding, normed per layer by per_layer_proj_norm [size]
    per_layer_embed: Matrix | None = None
    per_layer_model_proj: Matrix | None = None
    per_layer_proj_norm: torch.Tensor | None = None

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
        mats = [self.embed, self.final_norm, self.head, self.per_layer_embed,
                self.per_layer_model_proj, self.per_layer_proj_norm]
        for layer in self.layers:
            mats += layer.parts().values()
        for m in mats:
            tensors.update((id(t), t) for t in matrix_tensors(m))
        return sum(t.nbytes for t in tensors.values())


def matrix_tensors(m: Matrix | None) -> list[torch.Tensor]:
    """The tensors that hold a matrix's bytes, whatever its kind (none for None)."""
    parts = [] if m is None else ([m.data, m.scales, m.mins] if isinstance(m, PackedMatrix) else
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


def gemma4_layer_fields(fields: dict[str, object], cfg: ModelConfig, layer_id: int,
                        device: torch.device | str) -> None:
    """A loaded Gemma 4 layer's fields (as read from its file) made what the graph reads: a
    layer scalar of exactly 1 dropped (times 1 is the identity: no op at all), and the V
    norm's unit gain, which no file holds."""
    if bool((fields["layer_scalar"] == 1.0).all()):
        fields["layer_scalar"] = None
    fields["v_norm"] = torch.ones(cfg.head_dim_of(cfg.layer_kinds[layer_id]), device=device)


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

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, device=device)

    def layer(layer_id: int) -> LayerWeights:
        kind = cfg.layer_kinds[layer_id]
        q, d, i, p = (cfg.num_heads * cfg.head_dim_of(kind), cfg.head_dim_of(kind),
                      cfg.intermediate_of(layer_id), cfg.per_layer_input_size)
        owner = cfg.kv_owner(layer_id) == layer_id
        return LayerWeights(
            attn_norm=norm(h), qkv=mat(qkv_rows(cfg, layer_id), h), q_norm=norm(d),
            k_norm=norm(d) if owner else None, o_proj=mat(h, q), post_attn_norm=norm(h),
            ffn_norm=norm(h), gate_up=mat(2 * i, h), down=mat(h, i), post_ffn_norm=norm(h),
            v_norm=ones(d) if cfg.v_norm else None,
            per_layer_gate=mat(p, h) if p else None, per_layer_proj=mat(h, p) if p else None,
            per_layer_norm=norm(h) if p else None, moe=experts() if cfg.num_experts else None)

    def experts() -> MoeWeights:
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        return MoeWeights(
            router=mat(e, h), router_scale=norm(h), expert_scale=norm(e),
            gate_up=[mat(2 * i, h) for _ in range(e)], down=[mat(h, i) for _ in range(e)],
            pre_norm=norm(h), post_norm=norm(h), post_dense_norm=norm(h))

    h, p = cfg.hidden_size, cfg.per_layer_input_size
    layers = [layer(layer_id) for layer_id in range(cfg.num_layers)]
    embed = (torch.randn(cfg.vocab_size, h, generator=gen, device=made_on) * 0.05).to(
        device, dtype)
    weights = ModelWeights(embed=embed, final_norm=norm(h), layers=layers)
    if p:
        ple = torch.randn(cfg.per_layer_vocab_size, cfg.num_layers * p, generator=gen,
                          device=made_on) * 0.05
        weights.per_layer_embed = ple.to(device, dtype)
        weights.per_layer_model_proj = mat(cfg.num_layers * p, h)
        weights.per_layer_proj_norm = norm(p)
    return weights


def qkv_rows(cfg: ModelConfig, layer_id: int) -> int:
    """Rows of a layer's fused projection: queries, then keys and values of the layer's kind,
    keys only on a K=V kind (the values are the keys' rows), neither on a KV-sharing layer."""
    kind = cfg.layer_kinds[layer_id]
    kv_heads, head_dim = cfg.kv_row(kind)
    kv = 0 if cfg.kv_owner(layer_id) != layer_id else 1 if kind in cfg.k_eq_v_kinds else 2
    return (cfg.num_heads + kv * kv_heads) * head_dim
