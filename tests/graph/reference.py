"""The Gemma 3 decoder in float64 plain torch, written from transformers' Gemma 3 code (not
from muser's ops): the oracle of whole-model tests on tiny random models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from muser.config import ModelConfig
from muser.graph.weights import ModelWeights
from muser.ops.packed import dense


def _rms(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, the stored gain already 1 + w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain.double()


def _rope(x: torch.Tensor, theta: float, scaling: float) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by position (rotate-half, as HF's apply_rotary_pos_emb)."""
    t, _, d = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d) / scaling
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
    rotated = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    return x * cos + rotated * sin


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
    """Causal (and windowed) attention of [T, heads, D] over [T, kv_heads, D] -> [T, heads * D]."""
    t, heads, _ = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    pos = torch.arange(t)
    visible = pos[:, None] >= pos[None, :]
    if window is not None:
        visible &= pos[:, None] - pos[None, :] < window
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v).reshape(t, -1)


def reference_logits(cfg: ModelConfig, weights: ModelWeights, ids: list[int],
                     rope_kinds: tuple[str, ...] | None = None) -> torch.Tensor:
    """Logits [len(ids), vocab] float64 of a prompt from position 0. `rope_kinds`: the layer
    kinds that rotate (default: those not in cfg.nope_kinds)."""
    if rope_kinds is None:
        rope_kinds = tuple(k for k in ("sliding", "global") if k not in cfg.nope_kinds)
    eps, heads, kv, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    embed = dense(weights.embed).double()
    h = embed[ids] * math.sqrt(cfg.hidden_size)
    for kind, w in zip(cfg.layer_kinds, weights.layers):
        x = _rms(h, w.attn_norm, eps)
        qkv = x @ dense(w.qkv).double().T
        q = _rms(qkv[:, : heads * d].reshape(-1, heads, d), w.q_norm, eps)
        k = _rms(qkv[:, heads * d:(heads + kv) * d].reshape(-1, kv, d), w.k_norm, eps)
        v = qkv[:, (heads + kv) * d:].reshape(-1, kv, d)
        if kind in rope_kinds:
            theta, scaling = ((cfg.rope_local_theta, 1.0) if kind == "sliding"
                              else (cfg.rope_theta, cfg.rope_scaling_factor))
            q, k = _rope(q, theta, scaling), _rope(k, theta, scaling)
        window = cfg.sliding_window if kind == "sliding" else None
        a = _attention(q, k, v, cfg.attn_scale, window) @ dense(w.o_proj).double().T
        h = h + _rms(a, w.post_attn_norm, eps)
        gate, up = (_rms(h, w.ffn_norm, eps) @ dense(w.gate_up).double().T).chunk(2, dim=-1)
        mlp = (F.gelu(gate, approximate="tanh") * up) @ dense(w.down).double().T
        h = h + _rms(mlp, w.post_ffn_norm, eps)
    return _rms(h, weights.final_norm, eps) @ embed.T
