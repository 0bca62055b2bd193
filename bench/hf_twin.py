"""A transformers Gemma3ForCausalLM that shares muser's (random) weights: the baseline and,
in float64 on the CPU, the numerical reference. Matrices are views of muser's fused tensors
(no extra memory on the GPU); norms are converted back to HF's (w - 1) convention."""

from __future__ import annotations

import types

import torch

from muser.config import ModelConfig
from muser.graph.weights import ModelWeights


def hf_config(cfg: ModelConfig, attn: str = "sdpa"):
    from transformers import Gemma3TextConfig

    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor != 1.0:
        full = {"rope_type": "linear", "factor": cfg.rope_scaling_factor,
                "rope_theta": cfg.rope_theta}
    return Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        sliding_window=cfg.sliding_window, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        layer_types=["sliding_attention" if k == "sliding" else "full_attention"
                     for k in cfg.layer_kinds],
        rope_parameters={"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.rope_local_theta}},
        attn_implementation=attn, tie_word_embeddings=True,
    )


def _exact_norm(module: torch.nn.Module) -> None:
    """HF's Gemma3RMSNorm upcasts to float32; keep float64 end to end for the reference."""

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y * (1.0 + self.weight.to(x.dtype))

    module.forward = types.MethodType(forward, module)


def hf_twin(cfg: ModelConfig, w: ModelWeights, device: str, dtype: torch.dtype,
            attn: str = "sdpa"):
    """Gemma3ForCausalLM on `device` in `dtype` with muser's weights (views when the dtype and
    device match, copies otherwise)."""
    from accelerate import init_empty_weights
    from transformers import Gemma3ForCausalLM

    with init_empty_weights():
        model = Gemma3ForCausalLM(hf_config(cfg, attn))
    conv = lambda t: t.to(device=device, dtype=dtype)
    q, kv = cfg.q_size, cfg.kv_size
    params = {"model.embed_tokens.weight": conv(w.embed),
              "model.norm.weight": conv(w.final_norm - 1)}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        params |= {
            p + "self_attn.q_proj.weight": conv(lw.qkv[:q]),
            p + "self_attn.k_proj.weight": conv(lw.qkv[q:q + kv]),
            p + "self_attn.v_proj.weight": conv(lw.qkv[q + kv:]),
            p + "self_attn.o_proj.weight": conv(lw.o_proj),
            p + "self_attn.q_norm.weight": conv(lw.q_norm - 1),
            p + "self_attn.k_norm.weight": conv(lw.k_norm - 1),
            p + "input_layernorm.weight": conv(lw.attn_norm - 1),
            p + "post_attention_layernorm.weight": conv(lw.post_attn_norm - 1),
            p + "pre_feedforward_layernorm.weight": conv(lw.ffn_norm - 1),
            p + "post_feedforward_layernorm.weight": conv(lw.post_ffn_norm - 1),
            p + "mlp.gate_proj.weight": conv(lw.gate_up[:cfg.intermediate_size]),
            p + "mlp.up_proj.weight": conv(lw.gate_up[cfg.intermediate_size:]),
            p + "mlp.down_proj.weight": conv(lw.down),
        }
    for name, tensor in params.items():
        parent, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), attr,
                torch.nn.Parameter(tensor, requires_grad=False))
    model.lm_head.weight = model.model.embed_tokens.weight
    for name, buf in list(model.named_buffers()):
        parent, attr = name.rsplit(".", 1)
        value = buf.to(device)
        if buf.is_floating_point() and "inv_freq" not in name:
            value = value.to(dtype)
        setattr(model.get_submodule(parent), attr, value)
    if dtype == torch.float64:
        for module in model.modules():
            if type(module).__name__ == "Gemma3RMSNorm":
                _exact_norm(module)
    return model.eval()
