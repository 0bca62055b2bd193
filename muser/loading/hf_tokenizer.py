"""The tokenizer of a Hugging Face checkpoint: tokenizer.json through the `tokenizers` library,
special tokens and the chat template from tokenizer_config.json (or chat_template.jinja)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from muser.errors import ModelLoadError
from muser.loading.hf import read_json
from muser.tokenizer import (
    TYPE_BYTE,
    TYPE_CONTROL,
    TYPE_NORMAL,
    TYPE_UNUSED,
    TYPE_USER_DEFINED,
    Tokenizer,
    VocabSpec,
)

_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def tokenizer_from_hf(directory: Path, num_ids: int = 0) -> Tokenizer:
    """muser's Tokenizer over the checkpoint's tokenizer.json: added tokens marked special are
    control tokens, the others user-defined (both split out before encoding, as llama.cpp
    does), '<0xNN>' pieces are byte-fallback tokens. Ids up to `num_ids` (the embedding's rows)
    that the tokenizer lacks are unused tokens that decode to nothing (Gemma 3 4B and up pad
    262,145 tokens to 262,208 rows)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"Hugging Face checkpoint lacks tokenizer.json: {path}")
    try:
        encoder = HFTokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 (a bare Exception on malformed files)
        raise ModelLoadError(f"{path}: not a readable tokenizer.json ({exc})") from None
    tokens, types = _vocabulary(encoder, num_ids)
    ids = {t: i for i, t in enumerate(tokens)}
    settings = _settings(directory)
    spec = VocabSpec(
        tokens=tokens, scores=[0.0] * len(tokens), types=types,
        bos_id=_token_id(ids, settings.get("bos_token"), "<bos>", "bos_token"),
        eos_id=_token_id(ids, settings.get("eos_token"), "<eos>", "eos_token"),
        add_bos=bool(settings.get("add_bos_token", True)),
        add_eos=bool(settings.get("add_eos_token", False)),
        add_space_prefix=False,  # tokenizer.json's normalizer adds one where the model wants it
        chat_template=_chat_template(directory, settings),
    )
    try:
        return Tokenizer(spec, model_encoder(encoder))
    except ValueError as exc:  # e.g. no byte-fallback tokens
        raise ModelLoadError(f"{path}: {exc}") from None


def _vocabulary(hf: Any, num_ids: int) -> tuple[list[str], list[int]]:
    """Token texts by id and their llama.cpp types; ids without a token are unused."""
    ids = hf.get_vocab(with_added_tokens=True)
    tokens = [""] * max(max(ids.values()) + 1, num_ids)
    for text, i in ids.items():
        tokens[i] = text
    types = [TYPE_UNUSED if not t else TYPE_BYTE if _BYTE_TOKEN.fullmatch(t) else TYPE_NORMAL
             for t in tokens]
    for i, added in hf.get_added_tokens_decoder().items():
        types[i] = TYPE_CONTROL if added.special else TYPE_USER_DEFINED
    return tokens, types


def model_encoder(hf: Any) -> Callable[[str], list[int]]:
    """Text -> ids through tokenizer.json's normalizer, pre-tokenizer and model only: muser has
    split out the special tokens it parses, and what is left (a control token's text when not
    parsing specials, as llama.cpp) is plain text, never split out again."""
    normalizer, pre_tokenizer, model = hf.normalizer, hf.pre_tokenizer, hf.model

    def encode(text: str) -> list[int]:
        text = normalizer.normalize_str(text) if normalizer else text
        words = pre_tokenizer.pre_tokenize_str(text) if pre_tokenizer else [(text, None)]
        return [token.id for word, _ in words for token in model.tokenize(word)]

    return encode


def _settings(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json, or no settings when the checkpoint has none."""
    path = directory / "tokenizer_config.json"
    return read_json(path) if path.is_file() else {}


def _token_id(ids: dict[str, int], token: Any, default: str, key: str) -> int:
    """The id of a special token named in tokenizer_config.json (a string or {content: ...})."""
    text = token.get("content") if isinstance(token, dict) else token or default
    if text not in ids:
        raise ModelLoadError(f"tokenizer_config.json: {key} {text!r} is not in the vocabulary")
    return ids[text]


def _chat_template(directory: Path, settings: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template (the 'default' one of a list), else the
    checkpoint's chat_template.jinja, else None (muser's built-in Gemma format)."""
    template = settings.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text("utf-8")
    return template
