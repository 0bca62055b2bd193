"""SentencePiece (llama.cpp SPM) tokenizer read from GGUF metadata, matching llama.cpp token ids.
A Hugging Face tokenizer.json plugs in as the encoder of text between special tokens
(muser/loading/hf_tokenizer.py); special tokens, decoding and chat templates stay here."""

from __future__ import annotations

import codecs
import heapq
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    import gguf

SPACE_MARK = "\u2581"

TYPE_NORMAL = 1
TYPE_UNKNOWN = 2
TYPE_CONTROL = 3
TYPE_USER_DEFINED = 4
TYPE_UNUSED = 5
TYPE_BYTE = 6

ATTR_UNKNOWN = 1 << 1
ATTR_UNUSED = 1 << 2
ATTR_NORMAL = 1 << 3
ATTR_CONTROL = 1 << 4
ATTR_USER_DEFINED = 1 << 5
ATTR_BYTE = 1 << 6

_TYPE_TO_ATTR = {
    TYPE_NORMAL: ATTR_NORMAL,
    TYPE_UNKNOWN: ATTR_UNKNOWN,
    TYPE_CONTROL: ATTR_CONTROL,
    TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TYPE_UNUSED: ATTR_UNUSED,
    TYPE_BYTE: ATTR_BYTE,
}
_ATTR_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL
_ATTR_PARTITIONED = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN

# Token texts llama.cpp forces to CONTROL when loading a vocabulary (EOG/EOT/FIM auto-detection).
_FORCED_CONTROL_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
    "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>",
    "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>", "<|code_suffix|>",
    "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
    "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>", "<|fim_pad|>", "<fim-pad>",
    "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
    "<reponame>", "<|file_sep|>",
})
_FORCED_USER_DEFINED_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
# Ends of a turn, as llama.cpp reads them as end of generation: Gemma 3's, Gemma 4's, and Gemma
# 4's hand-over to a tool after its calls
_END_OF_TURN_TEXTS = ("<end_of_turn>", "<turn|>", "<|tool_response>")
_ASCII_SPACE = " \t\n\v\f\r"


@dataclass(frozen=True)
class VocabSpec:
    """Everything the tokenizer needs from a GGUF's tokenizer.* metadata."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int
    eos_id: int
    add_bos: bool = True
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str | None = None


class Tokenizer:
    """llama.cpp-compatible SPM tokenizer: special-token splitting, score merges, byte fallback."""

    def __init__(self, spec: VocabSpec,
                 encoder: Callable[[str], list[int]] | None = None) -> None:
        """Build the lookup tables once from a vocabulary spec. `encoder`: ids of the text
        between special tokens (a tokenizer.json's model) instead of the score merges."""
        self._encoder = encoder
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(spec.tokens)]
        self.vocab_size = len(tokens)
        self.bos_id = spec.bos_id
        self.eos_id = spec.eos_id
        self.add_bos = spec.add_bos
        self.add_eos = spec.add_eos
        self.add_space_prefix = spec.add_space_prefix
        self.chat_template = spec.chat_template
        self._texts = tokens
        self._scores = [float(s) for s in spec.scores]
        self._ids = {text: i for i, text in enumerate(tokens)}
        self._attrs = _token_attrs(tokens, spec.types)
        self._byte_ids = [self._byte_token(b) for b in range(256)]
        self._pieces = [self._make_piece(i) for i in range(self.vocab_size)]
        self._special_text = {
            tokens[i]: i for i in range(self.vocab_size) if self._attrs[i] & _ATTR_PARTITIONED
        }
        self._special_prefixes = {t[:k] for t in self._special_text for k in range(1, len(t) + 1)}
        self._special_starts = re.compile(
            "[" + "".join(sorted({re.escape(t[0]) for t in self._special_text})) + "]"
        ) if self._special_text else None
        ends = (self.eos_id, *(self._ids.get(t) for t in _END_OF_TURN_TEXTS))
        self.eot_ids = frozenset(i for i in ends if i is not None)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Read the tokenizer from a GGUF file; ValueError if its tokenizer model is unsupported."""
        return cls(spec_from_gguf(reader))

    def difference(self, draft: Tokenizer) -> str | None:
        """What keeps a draft model's ids (`draft`'s vocabulary) from reading as this one's, in
        words; None: every id `draft` has is the same token here, special where it is special
        here, with the same BOS / EOS / end-of-turn ids. This one may have ids past the
        draft's last (a vocabulary padded to a larger embedding): the draft never proposes
        them."""
        if draft.vocab_size > self.vocab_size:
            return (f"the draft has {draft.vocab_size} tokens, the target {self.vocab_size}: "
                    f"ids {self.vocab_size} to {draft.vocab_size - 1} are not the target's")
        for name in ("bos_id", "eos_id", "eot_ids"):
            a, b = getattr(self, name), getattr(draft, name)
            if a != b:
                shown = (sorted(a), sorted(b)) if name == "eot_ids" else (a, b)
                return f"{name}: the target's is {shown[0]}, the draft's {shown[1]}"
        for i, (a, b) in enumerate(zip(self._texts, draft._texts)):
            if a != b:
                return f"token {i} is {a!r} in the target, {b!r} in the draft"
        for i, (a, b) in enumerate(zip(self._attrs, draft._attrs)):
            if (a ^ b) & (_ATTR_SPECIAL | _ATTR_PARTITIONED):
                return (f"token {i} ({self._texts[i]!r}) is special in one and not the other "
                        f"(target: {self.is_special(i)}, draft: {draft.is_special(i)})")
        return None

    def is_special(self, token_id: int) -> bool:
        """Whether the token is a control/unknown token (hidden when decoding with skip_special)."""
        return bool(self._attrs[token_id] & _ATTR_SPECIAL)

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is exactly `text`, if any."""
        return self._ids.get(text)

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids for `text`, as llama_tokenize(add_special=True, parse_special) gives them."""
        add_special = self.add_bos if add_bos is None else add_bos
        out: list[int] = [self.bos_id] if add_special else []
        prev_special = True
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                fragment = " " + fragment
            if self._encoder is None:
                self._spm(fragment.replace(" ", SPACE_MARK), out)
            else:
                out.extend(self._encoder(fragment))
            prev_special = False
        if self.add_eos and add_bos is not False:
            out.append(self.eos_id)
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of the ids (llama_detokenize with unparse_special = not skip_special)."""
        data = b"".join(self._piece(i, skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_to_piece(self, token_id: int) -> bytes:
        """The raw bytes this token contributes (byte tokens -> one byte, '▁' -> space)."""
        return self._piece(token_id, False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation with the GGUF's jinja template, else Gemma's built-in format."""
        if self.chat_template:
            return self._render_jinja(messages, add_generation_prompt)
        return gemma_chat_format(messages, add_generation_prompt)

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        """Bytes of one token, empty for control/unknown tokens when skip_special."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        if skip_special and self._attrs[token_id] & _ATTR_SPECIAL:
            return b""
        return self._pieces[token_id]

    def _make_piece(self, token_id: int) -> bytes:
        """llama.cpp's token_to_piece(special=True) for one token."""
        attr = self._attrs[token_id]
        text = self._texts[token_id]
        if attr & (_ATTR_SPECIAL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            return text.replace(SPACE_MARK, " ").encode("utf-8")
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""

    def _byte_token(self, byte: int) -> int:
        """Id of the byte-fallback token for one byte."""
        token = self._ids.get(f"<0x{byte:02X}>")
        if token is None:
            token = self._ids.get(chr(byte))
        if token is None:
            raise ValueError(f"vocabulary has no byte-fallback token for byte 0x{byte:02X}")
        return token

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split text into raw fragments and special-token ids (llama.cpp st_partition)."""
        if not text:
            return []
        fragments: list[str | int] = [text]
        for special in self._specials_in(text, parse_special):
            fragments = _split_on(fragments, special, self._special_text[special])
        return fragments

    def _specials_in(self, text: str, parse_special: bool) -> list[str]:
        """Special-token texts occurring in `text`, longest (in UTF-8 bytes) first."""
        if self._special_starts is None:
            return []
        found: set[str] = set()
        prefixes, specials = self._special_prefixes, self._special_text
        for match in self._special_starts.finditer(text):
            start = match.start()
            end = start + 1
            while end <= len(text) and (sub := text[start:end]) in prefixes:
                if sub in specials:
                    found.add(sub)
                end += 1
        if not parse_special:
            found = {t for t in found if not self._attrs[specials[t]] & _ATTR_SPECIAL}
        return sorted(found, key=lambda t: (-len(t.encode("utf-8")), specials[t]))

    def _spm(self, text: str, out: list[int]) -> None:
        """Merge characters by best-scoring vocabulary bigram (llm_tokenizer_spm_session)."""
        syms = list(text)
        n = len(syms)
        if n == 0:
            return
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        ids, scores = self._ids, self._scores
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            token = ids.get(syms[i] + syms[i + 1])
            if token is not None:
                heap.append((-scores[token], i, i + 1, 2))
        heapq.heapify(heap)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            lsym, rsym = syms[left], syms[right]
            if not lsym or not rsym or len(lsym) + len(rsym) != size:
                continue
            syms[left] = lsym + rsym
            syms[right] = ""
            after = nxt[left] = nxt[right]
            if after >= 0:
                prev[after] = left
            before = prev[left]
            if before >= 0:
                self._push_bigram(heap, syms, before, left)
            if after >= 0:
                self._push_bigram(heap, syms, left, after)
        i = 0
        while i != -1:
            self._emit(syms[i], out)
            i = nxt[i]

    def _push_bigram(
        self, heap: list[tuple[float, int, int, int]], syms: list[str], left: int, right: int
    ) -> None:
        """Queue the merge of two adjacent symbols if their concatenation is a token."""
        text = syms[left] + syms[right]
        token = self._ids.get(text)
        if token is not None:
            heapq.heappush(heap, (-self._scores[token], left, right, len(text)))

    def _emit(self, sym: str, out: list[int]) -> None:
        """Append the token for a final symbol, or its UTF-8 bytes as byte-fallback tokens."""
        token = self._ids.get(sym)
        if token is not None:
            out.append(token)
            return
        byte_ids = self._byte_ids
        out.extend(byte_ids[b] for b in sym.encode("utf-8", errors="surrogatepass"))

    def _render_jinja(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """Render the GGUF's jinja chat template, dropping a leading BOS that encode() will add."""
        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        bos, eos = self._texts[self.bos_id], self._texts[self.eos_id]
        text = env.from_string(self.chat_template or "").render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
        )
        if self.add_bos and text.startswith(bos):
            text = text[len(bos):]
        return text


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        """Start an empty stream."""
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        return self._utf8.decode(self.tokenizer._piece(token_id, self.skip_special))

    def flush(self) -> str:
        """Return whatever remains, invalid or unfinished bytes replaced with U+FFFD."""
        return self._utf8.decode(b"", final=True)


def gemma_chat_format(messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    """llama.cpp's built-in Gemma chat format (system folded into the next user turn)."""
    parts: list[str] = []
    system = ""
    for message in messages:
        role = message["role"]
        content = _message_text(message.get("content"))
        if role == "system":
            system += content
            continue
        role = "model" if role == "assistant" else role
        parts.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            parts.append(system + "\n\n")
            system = ""
        parts.append(content + "<end_of_turn>\n")
    if add_generation_prompt:
        parts.append("<start_of_turn>model\n")
    return "".join(parts)


def _message_text(content: Any) -> str:
    """A message's text content (string or list of text parts), ASCII-whitespace trimmed."""
    if content is None:
        return ""
    if not isinstance(content, str):
        content = "".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
    return content.strip(_ASCII_SPACE)


def _split_on(fragments: list[str | int], special: str, token: int) -> list[str | int]:
    """Replace every occurrence of `special` in the raw fragments by its token id."""
    out: list[str | int] = []
    for fragment in fragments:
        if isinstance(fragment, int) or special not in fragment:
            out.append(fragment)
            continue
        pieces = fragment.split(special)
        for k, piece in enumerate(pieces):
            if k:
                out.append(token)
            if piece:
                out.append(piece)
    return out


def _token_attrs(tokens: list[str], types: Sequence[int]) -> list[int]:
    """Per-token llama.cpp attributes, including its load-time overrides by token text."""
    attrs = [_TYPE_TO_ATTR.get(int(t), 0) for t in types]
    for i, text in enumerate(tokens):
        if text in _FORCED_CONTROL_TEXTS:
            attrs[i] |= ATTR_CONTROL
        elif text in _FORCED_USER_DEFINED_TEXTS:
            attrs[i] = ATTR_USER_DEFINED
    return attrs


def spec_from_gguf(reader: gguf.GGUFReader, expected: str = "llama") -> VocabSpec:
    """Collect the tokenizer metadata of a GGUF file into a VocabSpec; ValueError unless its
    tokenizer model is `expected` (SentencePiece, 'llama', is the one Tokenizer merges by
    itself; muser/loading/gguf_tokenizer.py reads Gemma 4's 'gemma4' BPE)."""
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        raise ValueError("GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    if model != expected:
        raise ValueError(
            f"unsupported tokenizer model {model!r}: only SentencePiece ('llama') and Gemma 4's "
            f"BPE ('gemma4') are supported"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF tokenizer has no vocabulary (tokenizer.ggml.tokens is missing)")
    n = len(tokens)
    scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * n
    types = _field(reader, "tokenizer.ggml.token_type") or [TYPE_NORMAL] * n
    return VocabSpec(
        tokens=tokens,
        scores=scores,
        types=types,
        bos_id=_special_id(reader, "bos", 1, n),
        eos_id=_special_id(reader, "eos", 2, n),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def _special_id(reader: gguf.GGUFReader, name: str, default: int, n_tokens: int) -> int:
    """A special token id from metadata, falling back to llama.cpp's SPM default."""
    value = _field(reader, f"tokenizer.ggml.{name}_token_id")
    token = default if value is None or not 0 <= int(value) < n_tokens else int(value)
    if not 0 <= token < n_tokens:
        raise ValueError(f"GGUF tokenizer has no valid {name} token id")
    return token


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object, or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()
