"""Tiny synthetic GGUF files (bench/synth_gguf.py's writer) of a 2-layer Gemma 3 shape whose
every matrix width is a multiple of 256, so each --type keeps its block types."""

from __future__ import annotations

from pathlib import Path

import gguf

from bench.synth_gguf import write
from muser.config import ModelConfig, gemma3_layer_kinds

CFG = ModelConfig(
    architecture="gemma3", vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=128, layer_kinds=gemma3_layer_kinds(2, pattern=2),
    sliding_window=8, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=128.0,
    max_position_embeddings=64,
)


def tiny_gguf(directory: Path, kind: str) -> Path:
    """A CFG-shaped GGUF of `kind` (synth_gguf's --type) in `directory`, its vocabulary
    CFG.vocab_size placeholder tokens."""
    tokenizer = directory / "tokenizer.gguf"
    if not tokenizer.exists():
        writer = gguf.GGUFWriter(tokenizer, "gemma3")
        writer.add_tokenizer_model("llama")
        writer.add_token_list([f"<t{i}>" for i in range(CFG.vocab_size)])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return write(CFG, kind, tokenizer, directory / f"tiny-{kind}.gguf")
