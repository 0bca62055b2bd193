"""The device's memory at startup: the warm-up's peak and the graph pool measured on a GPU, the
KV pages sized from what is left (muser.memory.size_pages), and the report of what each
category holds (muser.memory.MemoryReport)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from muser.memory import MemoryReport, estimate_workspace, format_bytes, size_pages
from muser.runner import Runner
from muser.startup.log import StartupLog

T = TypeVar("T")


def peak_bytes(run: Callable[[], T], device: torch.device) -> tuple[T, int]:
    """(run()'s result, bytes allocated on a CUDA `device` at its peak beyond those allocated
    before it)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = run()
    torch.cuda.synchronize(device)
    return result, max(torch.cuda.max_memory_allocated(device) - before, 0)


def kept_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Bytes `run()` leaves reserved on a CUDA `device` (e.g. a CUDA graph pool), with the
    allocator's cache of free blocks returned before and after."""
    before = device_memory(device)[0]
    run()
    return max(before - device_memory(device)[0], 0)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA `device`, once the allocator's cached free blocks are
    returned to it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def size_kv_pages(runner: Runner, workspace: int, log: StartupLog) -> int:
    """Reallocate the runner's KV pages to what utilization x the GPU's memory holds beside
    what is in use and `workspace` (muser.memory.size_pages) -> how many."""
    e, per_seq = runner.engine, runner.pages_per_seq
    runner.pool.allocate_pages(0)
    free, total = device_memory(runner.device)
    num_pages = size_pages(free, total, e.gpu_memory_utilization, workspace,
                           runner.pool.page_nbytes, per_seq, e.max_num_seqs * per_seq)
    runner.resize_pages(num_pages)
    fmt = format_bytes
    log.note(f"kv pages: {num_pages} sized to {e.gpu_memory_utilization:.2f} x {fmt(total)} "
             f"less {fmt(total - free)} in use and {fmt(workspace)} of workspace (at most "
             f"{e.max_num_seqs * per_seq})")
    return num_pages


def estimated_workspace(runner: Runner) -> int:
    """The widest step's activations (muser.memory.estimate_workspace)."""
    e = runner.engine
    rows = min(max(e.prefill_chunk, e.max_batched_tokens), e.max_model_len)
    return estimate_workspace(runner.cfg, rows, e.max_model_len, e.max_num_seqs)


def memory_report(runner: Runner, workspace: int | None) -> MemoryReport:
    """What each category of the runner holds; workspace None: the widest step's estimate."""
    basis = "measured" if workspace is not None else "estimated"
    kv = runner.pool.nbytes()
    return MemoryReport(
        runner.model.weights.nbytes(), kv["kv_sliding"], kv["kv_pages"],
        estimated_workspace(runner) if workspace is None else workspace, basis,
        runner.pool.num_pages, runner.engine.page_size,
        runner.prefix.store.nbytes if runner.prefix is not None else 0)
