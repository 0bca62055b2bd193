"""The Gemma 3 decoder, written once and run at both widths (prefill chunk or decode rows).

embed * sqrt(hidden) -> per layer: norm -> QKV -> QK-norm + RoPE (the identity on the kinds in
ModelConfig.nope_kinds; given inside decode attention on a step of decode rows alone) ->
attention -> O -> post-attn norm + residual -> norm -> GeGLU MLP -> post-FFN norm + residual ->
final norm -> tied LM head.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from muser.attention.layer import attend
from muser.attention.plan import StepPlan, kind_window
from muser.config import ModelConfig
from muser.graph.weights import LayerWeights, ModelWeights
from muser.kvcache.pool import KVPool


class Decoder:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, pool: KVPool, ops: ModuleType):
        self.cfg, self.weights, self.pool, self.ops = cfg, weights, pool, ops

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: StepPlan,
        logit_rows: torch.Tensor | None, feed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [N] -> logits [len(logit_rows), vocab] float32 (every row's
        when logit_rows is None; no LM head at all when it is empty: a chunk in the middle of a
        prompt). feed: the ids of rows whose input_ids are negative, on the device."""
        cfg, w, ops = self.cfg, self.weights, self.ops
        # the residual stream, float32: Gemma scales the embedding by sqrt(hidden)
        h = ops.embed(w.embed, input_ids, math.sqrt(cfg.hidden_size), feed)
        # NOTE: a NoPE kind rotates every row by angle 0 (cos 1, sin 0): the identity, exactly
        at = {kind: torch.zeros_like(positions) if kind in cfg.nope_kinds else positions
              for kind in ("sliding", "global")}
        rope = {
            "sliding": ops.rope_cos_sin(at["sliding"], cfg.head_dim, cfg.rope_local_theta),
            "global": ops.rope_cos_sin(
                at["global"], cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor
            ),
        }
        x = ops.rms_norm(h, w.layers[0].attn_norm, cfg.rms_norm_eps, w.dtype)
        for layer_id, layer in enumerate(w.layers):
            next_norm = w.layers[layer_id + 1].attn_norm if layer_id + 1 < cfg.num_layers else (
                w.final_norm
            )
            h, x = self.layer(layer_id, layer, h, x, rope, plan, next_norm)
        if logit_rows is not None:
            if logit_rows.numel() == 0:
                return h.new_empty((0, cfg.vocab_size))
            x = x[logit_rows]
        logits = ops.linear(x, w.head).float()
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def layer(
        self, layer_id: int, w: LayerWeights, h: torch.Tensor, x: torch.Tensor,
        rope: dict, plan: StepPlan, next_norm: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: residual [N, hidden] f32, x: normed input in the projections' dtype -> (h, input
        of the next normed stage)."""
        cfg, ops = self.cfg, self.ops
        kind = cfg.layer_kinds[layer_id]
        n, act = x.shape[0], x.dtype  # act: the projections' input dtype
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
        qkv = ops.linear(x, w.qkv).view(n, heads + 2 * kv_heads, cfg.head_dim)  # per head
        q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        cos, sin = rope[kind]
        k_rows, v_rows = self.pool.rows(layer_id)
        decode = plan.decode[kind] if plan.decode else None
        norms = (w.q_norm, w.k_norm, cos, sin, cfg.rms_norm_eps)
        decode_alone = decode is not None and not plan.kinds[kind]
        if not decode_alone:
            store = (k_rows, v_rows, v, plan.stores[kind]) if plan.stores else None
            q, k = ops.qk_norm_rope_pair(q, k, *norms, k_rows.dtype, store)
        # NOTE: decode rows alone: decode attention normalizes and rotates them (no launch)
        norm_rope = norms if decode_alone else None
        a = attend(q, k, v, k_rows, v_rows, plan.kinds[kind], kind_window(kind, cfg),
                   cfg.attn_scale, plan.tile, ops, decode, norm_rope)
        h, x = ops.linear_add_rms_norm(a.reshape(n, cfg.q_size), w.o_proj, h, w.post_attn_norm,
                                       w.ffn_norm, cfg.rms_norm_eps, act)
        return ops.linear_add_rms_norm(ops.linear_geglu(x, w.gate_up), w.down, h,
                                       w.post_ffn_norm, next_norm, cfg.rms_norm_eps, act)
