"""The Gemma decoder (Gemma 3 and Gemma 4's text models), written once and run at both
widths (prefill chunk or decode rows).

embed * sqrt(hidden) -> per layer: norm -> QKV -> QK-norm + RoPE (the identity on the kinds in
ModelConfig.nope_kinds; given inside decode attention on a step of decode rows alone) ->
attention -> O -> post-attn norm + residual -> norm -> GeGLU MLP -> post-FFN norm + residual ->
final norm -> tied LM head.

Gemma 4's parts are per-layer data of the same stack: each kind's head size, KV heads and RoPE
(ModelConfig.kv_row, rope_fraction); values from the key projection on K=V kinds; values
RMS-normalized (v_norm); per-layer inputs (PLE: after the MLP, a gated projection of the
layer's slice of per_layer_inputs joins the residual); a layer scalar on the residual; routed
experts beside the MLP (muser/graph/moe.py: the two outputs normed and summed); and
KV-sharing layers, which project queries only and attend their owner's cache, rows the owner
stored in this step included (a STAGING chunk's rows are committed by the cache's last reader,
after every reader attended the shadow).
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from muser.attention.layer import attend
from muser.attention.plan import StepPlan, kind_window
from muser.config import ModelConfig
from muser.graph.moe import routed_experts
from muser.graph.weights import LayerWeights, ModelWeights
from muser.kvcache.pool import KVPool
from muser.ops.kv_fp8 import is_fp8


class Decoder:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, pool: KVPool, ops: ModuleType):
        self.cfg, self.weights, self.pool, self.ops = cfg, weights, pool, ops
        self.owners = [cfg.kv_owner(i) for i in range(cfg.num_layers)]
        # a layer commits a STAGING chunk's rows to the cache it reads when no later layer reads it
        self.commits = [cfg.last_reader(owner) == i for i, owner in enumerate(self.owners)]
        self.shared = {owner for i, owner in enumerate(self.owners) if owner != i}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: StepPlan,
        logit_rows: torch.Tensor | None, feed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [N] -> logits [len(logit_rows), vocab] float32 (every row's
        when logit_rows is None; no LM head at all when it is empty: a chunk in the middle of a
        prompt). feed: the ids of rows whose input_ids are negative, on the device."""
        return self.head(self.hidden(input_ids, positions, plan, feed), logit_rows)

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: StepPlan,
        feed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [N] -> the final hidden states [N, hidden] after the final
        norm, in the projections' dtype: the LM head's input (and an embedding's rows)."""
        cfg, w, ops = self.cfg, self.weights, self.ops
        # the residual stream, float32: Gemma scales the embedding by sqrt(hidden)
        h = ops.embed(w.embed, input_ids, math.sqrt(cfg.hidden_size), feed)
        per_layer = self.per_layer_inputs(input_ids, h, feed) if cfg.per_layer_input_size else None
        # NOTE: a NoPE kind rotates every row by angle 0 (cos 1, sin 0): the identity, exactly
        at = {kind: torch.zeros_like(positions) if kind in cfg.nope_kinds else positions
              for kind in ("sliding", "global")}
        rope = {
            "sliding": ops.rope_cos_sin(at["sliding"], cfg.head_dim, cfg.rope_local_theta),
            "global": ops.rope_cos_sin(
                at["global"], cfg.head_dim_of("global"), cfg.rope_theta, cfg.rope_scaling_factor,
                cfg.rope_fraction,
            ),
        }
        x = ops.rms_norm(h, w.layers[0].attn_norm, cfg.rms_norm_eps, w.dtype)
        new_rows: dict[int, tuple] = {}  # owner layer -> its stored K/V rows of this step
        for layer_id, layer in enumerate(w.layers):
            next_norm = w.layers[layer_id + 1].attn_norm if layer_id + 1 < cfg.num_layers else (
                w.final_norm
            )
            h, x = self.layer(layer_id, layer, h, x, rope, plan, next_norm, new_rows)
            if per_layer is not None or layer.layer_scalar is not None:
                h, x = self.layer_tail(layer_id, layer, h, x, per_layer, next_norm)
        return x

    def head(self, x: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states [N, hidden] -> logits [len(logit_rows), vocab] float32
        (every row's when logit_rows is None; none, and no LM head, when it is empty)."""
        cfg, ops = self.cfg, self.ops
        if logit_rows is not None:
            if logit_rows.numel() == 0:
                return x.new_empty((0, cfg.vocab_size), dtype=torch.float32)
            x = x[logit_rows]
        logits = ops.linear(x, self.weights.head).float()
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def per_layer_inputs(
        self, input_ids: torch.Tensor, h: torch.Tensor, feed: torch.Tensor | None
    ) -> torch.Tensor:
        """PLE: [N, layers, size] float32, (rms_norm(h @ proj^T / sqrt(hidden)) per layer +
        the tokens' rows of the per-layer table * sqrt(size)) / sqrt(2); h: the scaled
        embedding."""
        cfg, w, ops = self.cfg, self.weights, self.ops
        n, layers, size = input_ids.shape[0], cfg.num_layers, cfg.per_layer_input_size
        tokens = ops.embed(w.per_layer_embed, input_ids, math.sqrt(size), feed)
        proj = ops.linear(h.to(w.dtype), w.per_layer_model_proj) * cfg.hidden_size**-0.5
        proj = ops.rms_norm(proj.reshape(n * layers, size), w.per_layer_proj_norm,
                            cfg.rms_norm_eps)
        return (proj.view(n, layers, size) + tokens.view(n, layers, size)) * 2.0**-0.5

    def layer(
        self, layer_id: int, w: LayerWeights, h: torch.Tensor, x: torch.Tensor,
        rope: dict, plan: StepPlan, next_norm: torch.Tensor, new_rows: dict[int, tuple],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: residual [N, hidden] f32, x: normed input in the projections' dtype -> (h, input
        of the next normed stage). new_rows: the step's K/V rows of owner layers whose cache
        a later layer reads (filled here for those, read here by the layers sharing them)."""
        cfg, ops = self.cfg, self.ops
        kind, owner = cfg.layer_kinds[layer_id], self.owners[layer_id]
        n, act = x.shape[0], x.dtype  # act: the projections' input dtype
        heads = cfg.num_heads
        kv_heads, head_dim = cfg.kv_row(kind)
        qkv = ops.linear(x, w.qkv).view(n, -1, head_dim)  # per head
        q = qkv[:, :heads]
        cos, sin = rope[kind]
        k_rows, v_rows = self.pool.rows(layer_id)
        decode = plan.decode[kind] if plan.decode else None
        # decode rows alone: decode attention normalizes and rotates them itself, where the
        # backend gives the same bits as ops.qk_norm_rope_pair that way
        decode_alone = decode is not None and not plan.kinds[kind] and ops.decode_norm_rope()
        if owner != layer_id:  # KV sharing: the owner's rows, stored already
            q = ops.qk_norm_rope(q, w.q_norm, cos, sin, cfg.rms_norm_eps)
            k, v = new_rows.get(owner, (None, None))
            norm_rope = None
        else:
            k = qkv[:, heads:heads + kv_heads]
            v = k if kind in cfg.k_eq_v_kinds else qkv[:, heads + kv_heads:]
            if w.v_norm is not None:
                v = ops.rms_norm(v.reshape(n * kv_heads, head_dim), w.v_norm,
                                 cfg.rms_norm_eps).view(n, kv_heads, head_dim)
            norms = (w.q_norm, w.k_norm, cos, sin, cfg.rms_norm_eps)
            if not decode_alone:
                store = (k_rows, v_rows, v, plan.stores[kind]) if plan.stores else None
                # NOTE: an FP8 cache's codes round the float32 keys once, whichever op stores
                k_dtype = torch.float32 if is_fp8(k_rows) else k_rows.dtype
                q, k = ops.qk_norm_rope_pair(q, k, *norms, k_dtype, store)
                if layer_id in self.shared:
                    new_rows[layer_id] = (k, v)
            # NOTE: decode rows alone: decode attention normalizes and rotates them (no launch)
            norm_rope = norms if decode_alone else None
        a = attend(q, k, v, k_rows, v_rows, plan.kinds[kind], kind_window(kind, cfg),
                   cfg.attn_scale, plan.tile, ops, decode, norm_rope,
                   store=owner == layer_id, commit=self.commits[layer_id], dtype=act)
        h, x = ops.linear_add_rms_norm(a.reshape(n, heads * head_dim), w.o_proj, h,
                                       w.post_attn_norm, w.ffn_norm, cfg.rms_norm_eps, act)
        if w.moe is not None:  # the dense MLP and the routed experts, each normed, summed
            mlp = ops.rms_norm(ops.linear(ops.linear_geglu(x, w.gate_up), w.down),
                               w.moe.post_dense_norm, cfg.rms_norm_eps)
            mlp = mlp + routed_experts(h, w.moe, cfg, ops, act)
            return ops.add_rms_norm(h, mlp, w.post_ffn_norm, next_norm, cfg.rms_norm_eps, act)
        return ops.linear_add_rms_norm(ops.linear_geglu(x, w.gate_up), w.down, h,
                                       w.post_ffn_norm, next_norm, cfg.rms_norm_eps, act)

    def layer_tail(
        self, layer_id: int, w: LayerWeights, h: torch.Tensor, x: torch.Tensor,
        per_layer: torch.Tensor | None, next_norm: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma 4's end of a layer: the per-layer input gated in (PLE), then the residual
        times the layer scalar -> (h, input of the next normed stage)."""
        cfg, ops = self.cfg, self.ops
        act = x.dtype
        if per_layer is not None:
            gate = ops.linear(h.to(act), w.per_layer_gate)
            gated = ops.geglu(torch.cat((gate, per_layer[:, layer_id]), -1))  # gelu(gate) * p
            h, x = ops.linear_add_rms_norm(gated, w.per_layer_proj, h, w.per_layer_norm,
                                           next_norm, cfg.rms_norm_eps, act)
        if w.layer_scalar is not None:
            h = h * w.layer_scalar
            x = ops.rms_norm(h, next_norm, cfg.rms_norm_eps, act)
        return h, x
