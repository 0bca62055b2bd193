"""An LLM let go is freed: LLM() freezes startup's objects for the collector (gc.freeze), so a
reference cycle through them would keep the model, its KV and its engine for the process's
life — each LLM a test, a notebook or a bench makes would add its memory."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest

from muser import LLM, SamplingParams


def test_a_dropped_llm_frees_its_engine_and_model(gguf_path: Path) -> None:
    llm = LLM(str(gguf_path), device="cpu", max_model_len=256, max_num_seqs=4)
    outs = list(llm.stream("Name three colours:", SamplingParams(max_tokens=6, n=2, seed=1)))
    assert {out.index for out in outs} == {0, 1}  # the second sample came from a fork
    with pytest.raises(TypeError, match="one prompt per call"):  # and a refused call holds none
        llm.generate(["Red", "Blue"], SamplingParams(max_tokens=1))
    engine, runner = weakref.ref(llm.engine), weakref.ref(llm.runner)
    del llm, outs
    assert engine() is None and runner() is None
