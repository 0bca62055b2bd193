"""EngineConfig: for_device resolves the backend's defaults before the one construction; the
constructor takes final values only; the result is frozen."""

from __future__ import annotations

import dataclasses

import pytest

from muser.config import EngineConfig


def test_cpu_defaults() -> None:
    c = EngineConfig.for_device("cpu")
    assert (c.max_num_seqs, c.max_batched_tokens, c.decode_waiting_chunk, c.prefill_chunk) == (
        8, 512, 64, 512)
    assert (c.prefix_cache, c.prefix_cache_gb, c.fp8_head) == (True, 1.0, False)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_gpu_defaults(device: str) -> None:
    c = EngineConfig.for_device(device)
    assert (c.max_num_seqs, c.max_batched_tokens, c.prefill_chunk) == (32, 2048, 2048)
    assert c.decode_waiting_chunk is None  # NOTE: the startup measures it
    assert (c.prefix_cache, c.prefix_cache_gb, c.fp8_head) == (True, 8.0, False)


def test_given_values_win_and_none_means_default() -> None:
    c = EngineConfig.for_device("cuda", max_num_seqs=4, decode_waiting_chunk=256,
                                prefix_cache=False, prefix_cache_gb=None, quantization="fp8")
    assert (c.max_num_seqs, c.decode_waiting_chunk, c.prefix_cache) == (4, 256, False)
    assert (c.max_batched_tokens, c.prefix_cache_gb, c.fp8_head) == (2048, 8.0, True)
    assert EngineConfig.for_device("cpu", max_num_seqs=None).max_num_seqs == 8


def test_frozen() -> None:
    c = EngineConfig.for_device("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_num_seqs = 2  # type: ignore[misc]
    measured = dataclasses.replace(c, decode_waiting_chunk=128)
    assert (measured.decode_waiting_chunk, c.decode_waiting_chunk) == (128, 64)


def test_constructor_takes_final_values() -> None:
    final = dataclasses.asdict(EngineConfig.for_device("cpu"))
    assert EngineConfig(**final) == EngineConfig.for_device("cpu")
    with pytest.raises(TypeError, match="max_num_seqs"):
        EngineConfig(**{k: v for k, v in final.items() if k != "max_num_seqs"})
    with pytest.raises(ValueError, match="needs a value for prefill_chunk, prefix_cache_gb"):
        EngineConfig(**final | {"prefill_chunk": None, "prefix_cache_gb": None})
    with pytest.raises(ValueError, match="needs a value for decode_waiting_chunk"):
        EngineConfig(**final | {"decode_waiting_chunk": None})
    assert EngineConfig(**final | {"device": "cuda", "decode_waiting_chunk": None})


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match=r"max_batched_tokens \(16\) must hold one decode row"):
        EngineConfig.for_device("cpu", max_num_seqs=32, max_batched_tokens=16)
    with pytest.raises(ValueError, match="quantization must be one of none, fp8, got 'int4'"):
        EngineConfig.for_device("cpu", quantization="int4")
    with pytest.raises(ValueError, match="fp8_head applies to quantization 'fp8' only"):
        EngineConfig.for_device("cpu", fp8_head=True)
    with pytest.raises(ValueError, match="speculative must be one of none, ngram, draft"):
        EngineConfig.for_device("cpu", speculative="eagle")
    with pytest.raises(ValueError, match="speculative 'draft' needs a speculative_model"):
        EngineConfig.for_device("cpu", speculative="draft")
    with pytest.raises(ValueError, match="a speculative_model needs speculative 'draft'"):
        EngineConfig.for_device("cpu", speculative="ngram", speculative_model="gemma3-270m")
    with pytest.raises(ValueError, match="speculative 'draft' runs on the CPU for now"):
        EngineConfig.for_device("cuda", speculative="draft", speculative_model="gemma3-270m")
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        EngineConfig.for_device("cpu", speculative="ngram", num_speculative_tokens=0)
    # NOTE: on a GPU the weights decide (startup's check: tests/ops/test_exact_order.py)
    assert EngineConfig.for_device("cuda", speculative="ngram").speculative == "ngram"
    with pytest.raises(ValueError, match="kv_host_gb must be >= 0"):
        EngineConfig.for_device("cpu", kv_host_gb=-1.0)
    with pytest.raises(ValueError, match="kv_host_gb .* needs the prefix cache"):
        EngineConfig.for_device("cpu", kv_host_gb=1.0, prefix_cache=False)


def test_kv_dtype_fp8_is_a_gpu_cache(monkeypatch) -> None:
    """fp8 is one of the KV dtypes; the CPU's kernels refuse it at construction (before any
    model loads), unless the ops are the torch reference's (MUSER_OPS=ref, which reads it)."""
    assert EngineConfig.for_device("cuda", kv_dtype="fp8").kv_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_dtype must be one of bfloat16, float16, float32, "
                                         "fp8, got 'int8'"):
        EngineConfig.for_device("cuda", kv_dtype="int8")
    monkeypatch.delenv("MUSER_OPS", raising=False)
    with pytest.raises(ValueError, match="an FP8 KV cache runs on the GPU"):
        EngineConfig.for_device("cpu", kv_dtype="fp8")
    monkeypatch.setenv("MUSER_OPS", "ref")
    assert EngineConfig.for_device("cpu", kv_dtype="fp8").kv_dtype == "fp8"


def test_kv_cache_dtype_is_kv_dtype_by_another_name() -> None:
    """--kv-cache-dtype and --kv-dtype set one field; auto leaves the device's default; LLM's
    kv_cache_dtype folds into kv_dtype, and naming both differently is an error."""
    import argparse

    from muser.engine_args import add_engine_args, engine_kwargs
    from muser.errors import MuserError
    from muser.llm import _kv_dtype_named_once

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for flag in ("--kv-cache-dtype", "--kv-dtype"):
        assert engine_kwargs(p.parse_args([flag, "fp8"]))["kv_dtype"] == "fp8"
    assert "kv_dtype" not in engine_kwargs(p.parse_args(["--kv-cache-dtype", "auto"]))
    assert "kv_dtype" not in engine_kwargs(p.parse_args([]))
    assert _kv_dtype_named_once({"kv_cache_dtype": "fp8"}) == {"kv_dtype": "fp8"}
    assert _kv_dtype_named_once({"kv_cache_dtype": "auto", "device": "cpu"}) == {"device": "cpu"}
    assert _kv_dtype_named_once({"kv_dtype": "fp8", "kv_cache_dtype": "fp8"}) == {
        "kv_dtype": "fp8"}
    with pytest.raises(MuserError, match="name one setting twice"):
        _kv_dtype_named_once({"kv_dtype": "float32", "kv_cache_dtype": "fp8"})
