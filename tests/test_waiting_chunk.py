"""decode_waiting_chunk by measurement: the rule on step times (pure), and a real measurement
on a small CPU runner that leaves every slot and page as it found them."""

from __future__ import annotations

import dataclasses

import torch

from muser.config import EngineConfig, ModelConfig, gemma3_layer_kinds
from muser.graph.weights import random_weights
from muser.runner import Runner
from muser.startup import waiting_chunk


def test_the_largest_cap_within_twice_the_decode_step() -> None:
    # step times of the shape of gemma3-27b at batch 32 on an H200 (bench/results)
    mixed = {64: 22.4, 128: 25.9, 256: 33.7, 512: 58.9}
    assert waiting_chunk.choose(17.8, mixed) == 256
    assert waiting_chunk.choose(30.0, mixed) == 512
    assert waiting_chunk.choose(17.8, {64: 22.4}) == 64


def test_when_no_cap_is_within_the_least_delay_per_prefill_row_wins() -> None:
    # a step bound by fixed per-step costs: rows are nearly free up to a point
    mixed = {64: 8.8, 128: 8.9, 256: 9.3, 512: 9.7, 1024: 11.0}
    assert waiting_chunk.choose(1.9, mixed) == 1024
    # ... and past it, wider steps delay the streams more per row than they save
    assert waiting_chunk.choose(1.9, {64: 8.8, 128: 9.0, 256: 40.0}) == 128


def test_candidates_fit_the_step_beside_the_batch() -> None:
    assert waiting_chunk.candidates(2048, 28, 2048) == [64, 128, 256, 512, 1024]
    assert waiting_chunk.candidates(2048, 28, 512) == [64, 128, 256, 512]
    assert waiting_chunk.candidates(100, 40, 512) == []


CFG = ModelConfig(
    architecture="gemma3", vocab_size=32, hidden_size=16, intermediate_size=16, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=16, layer_kinds=gemma3_layer_kinds(2),
    sliding_window=8, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=16.0,
)


def test_measure_times_real_steps_and_frees_what_it_used() -> None:
    engine = EngineConfig.for_device(device="cpu", dtype="float32", kv_dtype="float32",
                                     max_num_seqs=16, prefill_chunk=64, max_batched_tokens=256,
                                     max_model_len=256, page_size=16)
    runner = Runner(CFG, engine, random_weights(CFG, torch.float32, "cpu", seed=0))
    slots, pages = len(runner.free_slots), runner.pages.num_free
    cap, measured = waiting_chunk.measure(runner, reps=1)
    assert measured["batch"] == 14  # 16 slots, 2 kept for the chunks
    assert sorted(measured["mixed_ms"]) == [64, 128]
    assert cap == waiting_chunk.choose(measured["decode_ms"], measured["mixed_ms"])
    assert (len(runner.free_slots), runner.pages.num_free) == (slots, pages)
    small = dataclasses.replace(engine, max_num_seqs=1, max_batched_tokens=64)
    runner = Runner(CFG, small, random_weights(CFG, torch.float32, "cpu", seed=0))
    assert waiting_chunk.measure(runner)[0] == 64  # no room for a mixed step: the smallest
    # a context shorter than a chunk (and than the caps): each chunk's rows fit one sequence
    short = dataclasses.replace(engine, max_num_seqs=8, prefill_chunk=512, max_model_len=100)
    runner = Runner(CFG, short, random_weights(CFG, torch.float32, "cpu", seed=0))
    slots, pages = len(runner.free_slots), runner.pages.num_free
    cap, measured = waiting_chunk.measure(runner, reps=1)
    assert sorted(measured["mixed_ms"]) == [64]  # one kept slot of at most 99 rows
    assert (len(runner.free_slots), runner.pages.num_free) == (slots, pages)
