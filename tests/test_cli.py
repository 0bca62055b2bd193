"""`muser generate` as a user runs it: a real process on the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _muser(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "muser", *args], input=stdin,
                          capture_output=True, text=True, timeout=600, check=False)


def _assert_clean_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_json(gguf_path: Path) -> None:
    proc = _muser("generate", "The capital of France is", "--model", str(gguf_path),
                  "--max-tokens", "6", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"prompt_token_ids", "token_ids", "text", "ttft_s", "tpot_s",
                        "prefill_tokens_per_s", "decode_tokens_per_s"}
    assert out["prompt_token_ids"][0] == 2 and len(out["token_ids"]) == 6
    assert out["text"].strip() and "<" not in out["text"]
    assert out["ttft_s"] > 0 and out["decode_tokens_per_s"] > 0


def test_generate_json_counts_the_drafts(gguf_path: Path) -> None:
    args = ("generate", "The cat. The cat. The cat. The cat.", "--model", str(gguf_path),
            "--max-tokens", "12", "--ignore-eos", "--json")
    plain, spec = _muser(*args), _muser(*args, "--speculative", "ngram")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    plain, spec = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert (plain["draft_tokens"], plain["accepted_tokens"]) == (0, 0)
    assert spec["draft_tokens"] >= spec["accepted_tokens"] > 0


def test_generate_streams_from_prompt_file_and_stdin(gguf_path: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Count: one, two, three,")
    args = ("--model", str(gguf_path), "--max-tokens", "5", "--ignore-eos", "--stop", "six")
    from_file = _muser("generate", "--prompt-file", str(prompt), *args)
    from_stdin = _muser("generate", *args, stdin=prompt.read_text())
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout == from_stdin.stdout and "four" in from_file.stdout


@pytest.mark.parametrize("args, needle", [
    (["generate", "hi", "--temperature", "-1"], "must be >= 0"),
    (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--max-tokens", "0"], "must be >= 1"),
    (["generate", "hi", "--model", "/nonexistent.gguf"], "model file not found"),
    (["generate", "--prompt-file", "/nonexistent.txt"], "cannot read --prompt-file"),
    (["generate", "hi", "--device", "cpu", "--quantization", "fp8"],
     "--quantization fp8 runs on a CUDA GPU of compute capability >= 8.9"),
    (["generate", "hi", "--speculative", "drafts"], "invalid choice: 'drafts'"),
    (["generate", "hi", "--speculative", "draft"], "needs a speculative_model"),
    (["generate", "hi", "--speculative", "draft", "--speculative-model", "/nonexistent.gguf"],
     "/nonexistent.gguf: no such file or directory"),
    (["generate", "hi", "--num-speculative-tokens", "0"], "must be >= 1"),
])
def test_bad_options_fail_cleanly(args: list[str], needle: str) -> None:
    _assert_clean_error(_muser(*args), needle)


def test_empty_and_over_long_prompts_fail_cleanly(gguf_path: Path) -> None:
    _assert_clean_error(_muser("generate", "", "--model", str(gguf_path)), "prompt is empty")
    long = _muser("generate", "word " * 100, "--model", str(gguf_path), "--max-model-len", "32")
    _assert_clean_error(long, "the context holds 32")


def test_bench_writes_a_receipt(gguf_path: Path, tmp_path: Path) -> None:
    """`muser bench` end to end on small cells; every decode repeat starts from a fresh
    prefill, so repeats x tokens may exceed what one sequence holds: 3 x 60 decode tokens
    against a context of 128 (the claim is only that the product exceeds the context, so a
    small context does: 180 decode steps instead of 600, ~10 s instead of ~22 s on 2 cores)."""
    out = tmp_path / "receipt.json"
    proc = _muser("bench", "--model", str(gguf_path), "--prompt-lengths", "8,40",
                  "--decode-tokens", "60", "--repeats", "3", "--max-model-len", "128",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    receipt = json.loads(out.read_text())
    cells = {c["name"]: c for c in receipt["cells"]}
    assert set(cells) == {"prefill_8", "prefill_40", "decode_60_after_32"}
    for cell in cells.values():
        assert len(cell["muser_runs"]) == 3 and cell["muser_tokens_per_s"] > 0
        if "llama.cpp_tokens_per_s" in cell:  # llama-cpp-python installed
            assert cell["ratio_vs_llama_cpp"] > 0
    machine = receipt["machine"]  # what ran it: the CPU, its vector ISA, threads, the load
    assert machine["cpu"] and machine["threads"] >= 1 and machine["device"] == "cpu"
    assert machine["muser_kernels"] in ("avx512", "avx2", "portable")
    assert all(f.startswith(("avx", "amx", "fma", "f16c", "sse4")) for f in machine["cpu_flags"])
    assert ("avx512f" in machine["cpu_flags"]) == (machine["muser_kernels"] == "avx512")
    assert set(machine["load_average_1_5_15min"]) == {"before", "after"}
