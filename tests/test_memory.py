"""Memory by category and KV page sizing, on the CPU: the sizing rule with fake free/total
figures, the page pool's reallocation, and the runner's report (its GPU sizing step driven by a
fake free-memory figure)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from muser.cli import build_parser, engine_kwargs
from muser.config import EngineConfig, ModelConfig, gemma3_layer_kinds
from muser.errors import MuserError
from muser.graph.weights import random_weights
from muser.kvcache.pool import KVPool
from muser.memory import CATEGORIES, MemoryReport, estimate_workspace, size_pages
from muser.runner import Runner
from muser.startup import StartupLog
from muser.startup.memory import size_kv_pages
from muser.startup.start import start

GiB, MiB = 1 << 30, 1 << 20
CFG = ModelConfig(
    architecture="gemma3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=6,
    num_heads=2, num_kv_heads=1, head_dim=16, layer_kinds=gemma3_layer_kinds(6, 3),
    sliding_window=8, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=16.0,
)


def _engine(**kw) -> EngineConfig:
    return EngineConfig.for_device(**{"device": "cpu", "dtype": "float32", "kv_dtype": "float32",
                                      "max_num_seqs": 3, "max_model_len": 40, "page_size": 8, **kw})


def _runner(log: StartupLog | None = None, **kw) -> Runner:
    return start(CFG, _engine(**kw), random_weights(CFG, torch.float32, "cpu", seed=0), log)


def test_pages_fill_what_utilization_leaves_after_use_and_workspace() -> None:
    # 0.9 * 100 GiB - 20 GiB in use - 6 GiB workspace = 64 GiB = 4096 pages of 16 MiB
    pages = size_pages(free=80 * GiB, total=100 * GiB, utilization=0.9, workspace=6 * GiB,
                       page_bytes=16 * MiB, min_pages=8, max_pages=10**6)
    assert pages == 4096
    assert size_pages(80 * GiB, 100 * GiB, 1.0, 6 * GiB, 16 * MiB, 8, 10**6) == 74 * 64


def test_pages_are_capped_by_what_every_sequence_could_use() -> None:
    assert size_pages(80 * GiB, 100 * GiB, 0.9, 0, 16 * MiB, 8, max_pages=100) == 100


def test_too_little_memory_for_one_sequence_says_how_much_is_missing() -> None:
    # 0.5 * 10 GiB - 4 GiB in use - 0.5 GiB workspace = 0.5 GiB; one sequence needs 1 GiB
    with pytest.raises(MuserError, match=r"1.0 GiB.*512.0 MiB missing"):
        size_pages(6 * GiB, 10 * GiB, 0.5, GiB // 2, 64 * MiB, min_pages=16, max_pages=64)
    with pytest.raises(MuserError, match="leaves -4.0 GiB: 5.0 GiB missing"):  # in use > share
        size_pages(GiB, 10 * GiB, 0.5, 0, 64 * MiB, min_pages=16, max_pages=64)


def test_workspace_estimate_grows_with_rows_and_context() -> None:
    base = estimate_workspace(CFG, rows=16, context=64, logit_rows=1)
    assert estimate_workspace(CFG, 32, 64, 1) > base
    assert estimate_workspace(CFG, 16, 128, 1) - base == 4 * 2 * 64 * CFG.kv_size
    assert estimate_workspace(CFG, 16, 64, 3) - base == 4 * 2 * CFG.vocab_size


def test_report_categories_and_line() -> None:
    m = MemoryReport(weights=300 * MiB, kv_sliding=15 * MiB, kv_pages=6 * MiB,
                     workspace=24 * MiB, workspace_basis="estimated", num_pages=4, page_size=256)
    assert tuple(m.categories()) == CATEGORIES and m.prefix_cache == 0
    assert m.total == 345 * MiB
    assert m.pretty() == ("memory: weights 300.0 MiB, kv sliding 15.0 MiB, kv pages 6.0 MiB "
                          "(4 x 256 rows), workspace 24.0 MiB (estimated), prefix cache 0 B; "
                          "total 345.0 MiB")


def test_pool_reallocates_its_pages_and_views() -> None:
    pool = KVPool(CFG, 3, 8, 5, 8, torch.float32, "cpu")
    rings = pool.rings
    assert pool.num_pages == 5 and pool.pages.nbytes == 5 * pool.page_nbytes
    assert pool.page_nbytes == 2 * 2 * 8 * CFG.kv_size * 4  # K and V, 2 full layers, float32
    pool.allocate_pages(11)
    assert pool.num_pages == 11 and pool.pages.nbytes == 11 * pool.page_nbytes
    full = CFG.layers_of("global")[0]
    k_rows, _ = pool.rows(full)
    assert k_rows.shape[0] == 11 * 8 and k_rows.data_ptr() == pool.pages.data_ptr()
    assert pool.layer(full)[0].shape[0] == 11 and pool.rings is rings


def test_cpu_runner_reports_what_it_holds() -> None:
    log = StartupLog(emit=(lines := []).append)
    runner = _runner(log)
    m = runner.memory
    assert m.weights == runner.model.weights.nbytes() > 0
    assert m.kv_sliding == runner.pool.rings.nbytes and m.kv_pages == runner.pool.pages.nbytes
    assert m.num_pages == runner.pages.num_pages == 3 * 5  # max_num_seqs x pages per sequence
    assert m.workspace_basis == "estimated" and m.workspace > 0
    assert m.prefix_cache == runner.prefix.store.nbytes > 0  # two checkpoints per page at most
    assert runner.prefix.stats().capacity == 30 and runner.prefix.store.rings.shape[0] == 30
    assert lines == ["startup: " + m.pretty()]
    assert _runner(num_pages=7).memory.num_pages == 7  # an explicit num_pages wins
    assert _runner(prefix_cache=False).memory.prefix_cache == 0


def test_gpu_sizing_step_with_a_fake_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """size_kv_pages as a GPU start runs it, the device's figures faked."""
    runner = _runner()
    page = runner.pool.page_nbytes
    total = 1000 * page
    monkeypatch.setattr("muser.startup.memory.device_memory",
                        lambda device: (total - 300 * page, total))
    lines: list[str] = []
    size_kv_pages(runner, 100 * page, StartupLog(emit=lines.append))  # 0.9 * 1000 - 300 - 100
    assert runner.pool.num_pages == 3 * 5  # capped: 3 sequences of 5 pages
    assert runner.pages.num_pages == runner.pages.num_free == 15
    runner = _runner(max_num_seqs=200)
    size_kv_pages(runner, 100 * page, StartupLog(emit=lines.append))
    assert runner.pool.num_pages == runner.pages.num_pages == 500
    assert runner.pool.pages.nbytes == 500 * page and "kv pages: 500" in lines[-1]
    with pytest.raises(MuserError, match="raise --gpu-memory-utilization"):
        size_kv_pages(_runner(gpu_memory_utilization=0.3), 100 * page, StartupLog())


def test_utilization_flag_and_field_are_validated() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--gpu-memory-utilization", "0.5"])
    assert engine_kwargs(args)["gpu_memory_utilization"] == 0.5
    assert engine_kwargs(parser.parse_args(["generate", "hi"]))["gpu_memory_utilization"] == 0.9
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "hi", "--gpu-memory-utilization", bad])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.for_device("cpu", gpu_memory_utilization=0.0)
    assert EngineConfig.for_device("cpu", gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0


def test_the_report_and_the_startup_record_import_without_torch() -> None:
    """The HTTP server's process reads MemoryReport (and the startup's record) without torch."""
    code = ("import sys, muser.memory, muser.startup, muser.env\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


def test_the_startup_record_is_frozen_and_the_runner_reads_it() -> None:
    runner = _runner()
    record = runner.startup
    assert runner.memory is record.memory and record.num_pages == runner.pool.num_pages
    assert record.waiting_chunk == runner.engine.decode_waiting_chunk and not record.phases
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.waiting_chunk = 1
