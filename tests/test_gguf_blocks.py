"""GGUF matrices kept as the file's blocks (the GPU's default: `load_weights(blocks=True)`):
which are kept, how fused rows stack, what is dequantized (and said so), the bytes held, and
the switch that asks for it."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bench import synth_gguf
from muser.cli import build_parser, engine_kwargs
from muser.config import EngineConfig
from muser.loading.gguf import config_from_gguf, load_weights, open_gguf
from muser.ops.blocks import BlockMatrix, BlockRows, Blocks, segments
from muser.ops.quants import dequantize
from tests.tiny_gguf import tiny_gguf

MATRICES = ["qkv", "o_proj", "gate_up", "down"]  # a Gemma 3 layer's


def _qtypes(w) -> list[str]:
    return [part.qtype.name for _, part in segments(w)]


def test_270m_keeps_every_matrix_and_holds_the_files_tensor_bytes(gguf_reader, gguf_path):
    """The embedded Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K matrices, float32 norms): every matrix
    stays blocks, so the weights hold exactly the bytes of the file's tensors (norms float32 as
    stored, the tied head the embedding's): the file's size less its header and metadata (the
    vocabulary) and alignment padding."""
    cfg = config_from_gguf(gguf_reader)
    w = load_weights(gguf_reader, cfg, torch.bfloat16, "cpu", blocks=True)
    assert isinstance(w.embed, BlockMatrix) and w.embed.qtype == Q.Q8_0 and w.head is w.embed
    for layer in w.layers:
        assert all(isinstance(getattr(layer, f), Blocks) for f in MATRICES)
    assert _qtypes(w.layers[0].qkv) == ["Q5_0", "Q8_0"]  # q, k Q5_0 in one segment; v Q8_0
    assert isinstance(w.layers[0].gate_up, BlockMatrix) and w.dtype == torch.bfloat16
    tensor_bytes = sum(int(t.n_bytes) for t in gguf_reader.tensors)
    first = min(int(t.data_offset) for t in gguf_reader.tensors)
    assert w.nbytes() == tensor_bytes
    padding = gguf_path.stat().st_size - first - tensor_bytes  # each tensor 32-byte aligned
    assert 0 <= padding < 32 * len(gguf_reader.tensors)
    # dequantized to bfloat16 the same weights would hold 2 bytes a value
    values = sum(int(np.prod(t.shape)) for t in gguf_reader.tensors)
    assert w.nbytes() < 0.5 * 2 * values


def test_fused_rows_are_the_parts_rows(gguf_reader):
    """QKV of a mixed-type layer, row by row: the segments' values are each part's own."""
    cfg = config_from_gguf(gguf_reader)
    w = load_weights(gguf_reader, cfg, torch.bfloat16, "cpu", blocks=True)
    tensors = {t.name: t for t in gguf_reader.tensors}

    def values(name):
        t = tensors[name]
        raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))
        return dequantize(raw, t.tensor_type, tuple(int(d) for d in reversed(t.shape)))

    want = torch.cat([values(f"blk.3.attn_{p}.weight") for p in "qkv"])
    got = torch.cat([part.dequantize() for _, part in segments(w.layers[3].qkv)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind,types", [
    ("q8_0", {"embed": ["Q8_0"], "qkv": ["Q8_0"], "down": ["Q8_0"]}),
    ("q4_k", {"embed": ["Q4_K"], "qkv": ["Q4_K"], "down": ["Q4_K"]}),
    ("q5_k", {"embed": ["Q5_K"], "qkv": ["Q5_K"], "down": ["Q5_K"]}),
    ("q4_0", {"embed": ["Q4_0"], "qkv": ["Q4_0"], "down": ["Q4_0"]}),
    ("q4_k_m", {"embed": ["Q6_K"], "qkv": ["Q4_K", "Q6_K"], "gate_up": ["Q4_K"],
                "down": ["Q6_K"]}),
])
def test_synth_gguf_types_stay_blocks(tmp_path, caplog, kind, types):
    """bench/synth_gguf.py's files of each --type the kernels read load as blocks, bytes as
    stored, nothing dequantized (no warning)."""
    reader = open_gguf(tiny_gguf(tmp_path, kind))
    with caplog.at_level(logging.WARNING, "muser.loading"):
        w = load_weights(reader, config_from_gguf(reader), torch.float32, "cpu", blocks=True)
    assert not caplog.records
    assert w.nbytes() == sum(int(t.n_bytes) for t in reader.tensors)
    for name, want in types.items():
        got = w.embed if name == "embed" else getattr(w.layers[1], name)
        assert _qtypes(got) == want
    assert isinstance(w.layers[0].qkv, BlockRows if kind == "q4_k_m" else BlockMatrix)


def test_types_without_a_kernel_are_dequantized_and_named(tmp_path, caplog, monkeypatch):
    """A BF16 attn_v: it is dequantized, and so are the q and k rows it is fused with (a fused
    matrix is all blocks or all values); the other matrices stay blocks; one warning names each
    dequantized tensor and why."""
    monkeypatch.setattr(synth_gguf, "_matrix_type",
                        lambda kind, name, cols: Q.BF16 if "attn_v" in name else Q.Q8_0)
    reader = open_gguf(tiny_gguf(tmp_path, "mixed"))
    with caplog.at_level(logging.WARNING, "muser.loading"):
        w = load_weights(reader, config_from_gguf(reader), torch.float32, "cpu", blocks=True)
    for layer in w.layers:
        assert isinstance(layer.qkv, torch.Tensor) and layer.qkv.dtype == torch.float32
        assert all(isinstance(getattr(layer, f), BlockMatrix) for f in MATRICES if f != "qkv")
    (record,) = caplog.records
    message = record.getMessage()
    assert "no block kernel reads BF16: blk.0.attn_v.weight, blk.1.attn_v.weight" in message
    assert ("fused with a BF16 part: blk.0.attn_q.weight, blk.0.attn_k.weight, "
            "blk.1.attn_q.weight, blk.1.attn_k.weight") in message


def test_dequantize_switch(tmp_path):
    """--gguf-weights: blocks by default, dequantize on request; the LLM keeps blocks only where
    the Triton backend runs (CUDA) and blocks are asked for."""
    from muser.llm import _keeps_blocks

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["generate", "hi"]))["gguf_weights"] == "blocks"
    args = parser.parse_args(["generate", "hi", "--gguf-weights", "dequantize"])
    assert engine_kwargs(args)["gguf_weights"] == "dequantize"
    assert "--gguf-weights" in parser._subparsers._group_actions[0].choices["generate"] \
        .format_help()
    with pytest.raises(ValueError, match="gguf_weights"):
        EngineConfig.for_device("cpu", gguf_weights="bf16")
    assert not _keeps_blocks(EngineConfig.for_device(device="cpu"))
    if importlib.util.find_spec("triton") is not None:
        assert _keeps_blocks(EngineConfig.for_device(device="cuda"))
        assert not _keeps_blocks(EngineConfig.for_device(device="cuda", gguf_weights="dequantize"))
