"""A GGUF file of a preset's shape with seeded random weights, for runs where no model file
can travel (the device machine): llama.cpp's `llama-bench` and muser's GGUF loader read it
like a converted checkpoint.

    python3 bench/synth_gguf.py --model-config gemma3-27b --type q4_k_m \
        --tokenizer .devcarry/tokenizer.gguf --out /dev/shm/gemma3-27b-q4_k_m.gguf

Metadata: llama.cpp's gemma3 keys from the preset's ModelConfig, the tokenizer's keys copied
from --tokenizer (a GGUF holding Gemma 3's vocabulary). Tensors: llama.cpp's gemma3 names and
shapes; norms float32 (ones plus noise); every matrix one block type (--type bf16, q8_0, q4_0,
q4_k, q5_k, q6_k) or, with q4_k_m, llama.cpp's Q4_K_M mix (Q6_K for attn_v and ffn_down, Q4_K
for the rest, Q6_K for the embedding); rows not made of 256-value blocks take llama.cpp's
fallback (Q5_0 for Q4_K, Q8_0 for Q6_K; Q5_0 for Q5_K, where llama.cpp takes Q5_1).
Quantizing a 27B in numpy takes hours, so a matrix is a small random [64, K] matrix whose
blocks are repeated down the rows: quantized by `gguf.quants` where it can (bf16, Q8_0, Q4_0),
random bytes with small finite f16 scales for the K-quants (which `gguf.quants` only
dequantizes). Valid blocks, the file's real byte count and layout, not
independent values: enough to time kernels, not to judge accuracy. Every type but bf16 (the
fallbacks included) is one the GPU keeps as blocks (muser/ops/blocks.py KERNEL_TYPES), so a
file of any --type but bf16 loads at its own size on the device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from muser.presets import preset

TYPES = {"bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K,
         "q6_k": Q.Q6_K}
SEED_ROWS = 64
# byte offsets of the f16 super-block scales in a K-quant block: Q4_K, Q5_K d, dmin; Q6_K d
SCALES = {Q.Q4_K: ((0, 2e-3), (2, 1e-3)), Q.Q5_K: ((0, 1e-3), (2, 1e-3)), Q.Q6_K: ((208, 2e-3),)}


# for rows not of 256-value blocks: llama.cpp's (for Q5_K it takes Q5_1, which no GPU kernel
# reads: Q5_0 here)
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}


def _matrix_type(kind: str, name: str, cols: int) -> Q:
    if kind != "q4_k_m":
        qtype = TYPES[kind]
    else:
        qtype = Q.Q6_K if name.endswith(("attn_v.weight", "ffn_down.weight",
                                         "token_embd.weight")) else Q.Q4_K
    return FALLBACK[qtype] if qtype in FALLBACK and cols % 256 else qtype


def _blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """[rows, cols] of `qtype` as the bytes gguf stores (uint8 [rows, bytes per row]), or
    bf16 held as uint16."""
    seed = rng.standard_normal((min(rows, SEED_ROWS), cols), dtype=np.float32) * 0.02
    if qtype == Q.BF16:
        seed = (seed.view(np.uint32) >> 16).astype(np.uint16)
    elif qtype in SCALES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (seed.shape[0], cols // block, size), dtype=np.uint8)
        for at, value in SCALES[qtype]:
            raw[:, :, at:at + 2] = np.array([value], np.float16).view(np.uint8)
        seed = raw.reshape(seed.shape[0], -1)
    else:
        seed = gguf.quants.quantize(seed, qtype)
    reps = -(-rows // seed.shape[0])
    return np.tile(seed, (reps, 1))[:rows]


def tensors(cfg, kind: str, rng: np.random.Generator):
    """(name, [rows, cols] or [n], qtype) in llama.cpp's gemma3 layout."""
    h, q, kv, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    yield "token_embd.weight", (cfg.vocab_size, h), _matrix_type(kind, "token_embd.weight", h)
    yield "output_norm.weight", (h,), Q.F32
    for i in range(cfg.num_layers):
        for name, shape in (("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
                            ("attn_output", (h, q)), ("ffn_gate", (cfg.intermediate_size, h)),
                            ("ffn_up", (cfg.intermediate_size, h)),
                            ("ffn_down", (h, cfg.intermediate_size))):
            full = f"blk.{i}.{name}.weight"
            yield full, shape, _matrix_type(kind, full, shape[1])
        for name, n in (("attn_norm", h), ("attn_q_norm", d), ("attn_k_norm", d),
                        ("post_attention_norm", h), ("ffn_norm", h), ("post_ffw_norm", h)):
            yield f"blk.{i}.{name}.weight", (n,), Q.F32


def write(cfg, kind: str, tokenizer: Path, out: Path, seed: int = 0) -> Path:
    writer = gguf.GGUFWriter(out, "gemma3")
    writer.add_name(f"synthetic {cfg.architecture} {kind}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_sliding_window(cfg.sliding_window)
    if cfg.rope_scaling_factor != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling_factor)
    reader = gguf.GGUFReader(tokenizer)
    pad = {"tokenizer.ggml.tokens": lambda i: f"<unused_pad{i}>",  # NOTE: llama.cpp wants
           "tokenizer.ggml.scores": lambda i: 0.0,  # one token per embedding row (the 27B has
           "tokenizer.ggml.token_type": lambda i: 5}  # 64 more rows than the vocabulary: unused)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            if field.name in pad and len(value) < cfg.vocab_size:
                value = value + [pad[field.name](i) for i in range(cfg.vocab_size - len(value))]
            writer.add_key_value(field.name, value, vtype, sub)
    rng = np.random.default_rng(seed)
    for name, shape, qtype in tensors(cfg, kind, rng):
        if qtype == Q.F32:
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            writer.add_tensor(name, data)
            continue
        data = _blocks(rng, *shape, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape if qtype != Q.BF16 else shape,
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="gemma3-27b")
    ap.add_argument("--type", choices=[*TYPES, "q4_k_m"], default="q4_k_m",
                    help="the matrices' block type, or llama.cpp's Q4_K_M mix; all but bf16 stay "
                    "blocks on the GPU (default: %(default)s)")
    ap.add_argument("--tokenizer", type=Path, required=True,
                    help="a GGUF holding Gemma 3's vocabulary (its tokenizer.* keys are copied)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = write(preset(args.model_config), args.type, args.tokenizer, args.out, args.seed)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
