"""The tokenizer of a GGUF file: SentencePiece ('llama', muser.tokenizer merges by score), or
Gemma 4's BPE ('gemma4'): the file's tokens and merges as a `tokenizers` BPE model over the
whole text, spaces written as '▁' and unknown bytes as '<0xNN>' tokens (byte fallback), as
llama.cpp's gemma4 vocabulary and the checkpoint's tokenizer.json read it."""

from __future__ import annotations

import dataclasses

import gguf
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers
from tokenizers.models import BPE

from muser.loading.hf_tokenizer import model_encoder
from muser.loading.reader import field
from muser.tokenizer import SPACE_MARK, Tokenizer, spec_from_gguf


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """The file's tokenizer; ValueError for a tokenizer model muser does not read."""
    if field(reader, "tokenizer.ggml.model", "") != "gemma4":
        return Tokenizer.from_gguf(reader)
    # NOTE: the BPE sees the text as it is (no '▁' prepended)
    spec = dataclasses.replace(spec_from_gguf(reader, "gemma4"), add_space_prefix=False)
    vocab = {text: i for i, text in enumerate(spec.tokens)}
    merges = [_pair(m) for m in field(reader, "tokenizer.ggml.merges", [])]
    encoder = HFTokenizer(BPE(vocab, merges, byte_fallback=True))
    encoder.normalizer = normalizers.Replace(" ", SPACE_MARK)
    return Tokenizer(spec, model_encoder(encoder))


def _pair(merge: str) -> tuple[str, str]:
    """A merge 'left right' -> (left, right)."""
    parts = merge.split(" ")
    if len(parts) != 2:
        raise ValueError(f"GGUF tokenizer merge {merge!r} is not two tokens")
    return parts[0], parts[1]
