"""Gemma 4's mixture of experts (26B-A4B): beside a layer's dense MLP, each token's residual
picks top_k_experts of num_experts GeGLU MLPs, whose outputs it sums by the router's weights.

router:  p = softmax(rms_norm(h) * router_scale / sqrt(hidden) @ router^T)   [N, experts]
         the top k of p, renormalized to sum 1, each times its expert_scale  [N, k]
experts: y_t = sum_j w_tj * down_e(geglu(gate_up_e(rms_norm(h_t, pre_norm)))), e = top_j(t)
out:     rms_norm(y, post_norm)

Each expert runs once a step over the rows routed to it (a decode step reads only the routed
experts' matrices). A row's result depends on that row alone: the CPU ops reduce each row in
one order whatever the rows beside it, and the k weighted outputs are added in rank order
(j = 0, 1, ...), so a token gets the same bits in any chunk or batch.
"""

from __future__ import annotations

from types import ModuleType

import torch

from muser.config import ModelConfig
from muser.graph.weights import MoeWeights


def route(h: torch.Tensor, w: MoeWeights, cfg: ModelConfig,
          ops: ModuleType) -> tuple[torch.Tensor, torch.Tensor]:
    """h: the residual [N, hidden] f32 -> (weights [N, k] f32, experts [N, k] int64), by
    rank: the k most probable experts, their probabilities renormalized, times expert_scale."""
    x = ops.rms_norm(h, w.router_scale, cfg.rms_norm_eps) * cfg.hidden_size**-0.5
    probs = torch.softmax(ops.linear(x, w.router), dim=-1)
    weights, experts = torch.topk(probs, cfg.top_k_experts, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * w.expert_scale[experts], experts


def routed_experts(h: torch.Tensor, w: MoeWeights, cfg: ModelConfig, ops: ModuleType,
                   act: torch.dtype) -> torch.Tensor:
    """h: the residual [N, hidden] f32 -> the experts' normed, weighted sum [N, hidden] f32.
    act: the projections' input dtype."""
    weights, experts = route(h, w, cfg, ops)
    x = ops.rms_norm(h, w.pre_norm, cfg.rms_norm_eps, act)
    out = h.new_zeros((h.shape[0], cfg.top_k_experts, cfg.hidden_size))  # [N, k, hidden]
    for e in torch.unique(experts).tolist():  # NOTE: only the experts some row routes to
        rows, ranks = torch.nonzero(experts == e, as_tuple=True)
        y = ops.linear(ops.linear_geglu(x[rows], w.gate_up[e]), w.down[e])
        out[rows, ranks] = y * weights[rows, ranks, None]
    total = out[:, 0]
    for rank in range(1, cfg.top_k_experts):
        total = total + out[:, rank]
    return ops.rms_norm(total, w.post_norm, cfg.rms_norm_eps)
