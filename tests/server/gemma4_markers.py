"""The embedded 270M's vocabulary with Gemma 4's tool and thinking markers as control tokens in
five of its `<unused…>` slots (no Gemma 4 tokenizer ships offline): as a Tokenizer, and as a
copy of the GGUF that a server loads, with a chat template in Gemma 4's manner (its
`<|tool_call>` selects the gemma4 tool format)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf

from muser.tokenizer import TYPE_CONTROL, Tokenizer, VocabSpec, spec_from_gguf

MARKERS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>")
TEMPLATE = """{{ bos_token }}{% if tools %}<start_of_turn>system
Call one of these functions as <|tool_call>call:NAME{key:value}<tool_call|>:
{% for t in tools %}{{ t.function | tojson }}
{% endfor %}<end_of_turn>
{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<start_of_turn>user
{{ m.name }} answered: {{ m.content }}<end_of_turn>
{% else %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}
{{ m.content or '' }}{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}\
{{ c.function.arguments | tojson }}<tool_call|>{% endfor %}<end_of_turn>
{% endif %}{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


def marked_spec(reader: gguf.GGUFReader) -> VocabSpec:
    """The GGUF's vocabulary, its first five unused tokens renamed to MARKERS (control)."""
    spec = spec_from_gguf(reader)
    tokens, types = list(spec.tokens), list(spec.types)
    slots = [i for i, t in enumerate(tokens) if t.startswith("<unused")][:len(MARKERS)]
    for i, marker in zip(slots, MARKERS, strict=True):
        tokens[i], types[i] = marker, TYPE_CONTROL
    return dataclasses.replace(spec, tokens=tokens, types=types)


def marked_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    return Tokenizer(marked_spec(reader))


def write_marked_gguf(reader: gguf.GGUFReader, path: Path) -> Path:
    """A copy of the GGUF with marked_spec's tokens (as gguf-py's gguf_new_metadata copies)."""
    spec = marked_spec(reader)
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    changed = {"tokenizer.ggml.tokens": spec.tokens, "tokenizer.ggml.token_type": spec.types}
    for name, field in reader.fields.items():
        if name == "general.architecture" or name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, changed.get(name, field.contents()), kind, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()
    return path
