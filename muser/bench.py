"""`muser bench`: prefill and decode tokens/s, with llama.cpp on the same file in the same run."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm import tqdm

from muser.engine_args import engine_kwargs
from muser.errors import MuserError
from muser.llm import LLM
from muser.ops import native


def _rates(tokens: int, make_runs: dict[str, Callable[[], Callable[[], None]]],
           repeats: int) -> dict[str, list[float]]:
    """tokens/s of `repeats` runs of each side, the sides taking turns run by run (a drift of
    the machine's speed reaches both alike); make_run() (untimed) sets each run up."""
    rates: dict[str, list[float]] = {name: [] for name in make_runs}
    for _ in range(repeats):
        for name, make_run in make_runs.items():
            run = make_run()
            start = time.perf_counter()
            run()
            rates[name].append(tokens / (time.perf_counter() - start))
    return rates


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(device: str, threads: int, llama: LlamaCppSide | None) -> dict:
    """What ran the cells: the CPU's model, cores and the threads each engine used; on the CPU
    also the vector ISA flags it advertises, the build muser's kernels run and llama.cpp's own
    account of its build."""
    machine = {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": threads,
               "device": device}
    if device == "cpu":
        machine |= {"cpu_flags": native.cpu_flags(), "muser_kernels": native.isa()}
    if llama is not None:
        machine["llama_cpp_system_info"] = llama.system_info
    return machine


def _prompt(vocab: int, length: int) -> list[int]:
    """A deterministic prompt: BOS then ordinary-token ids."""
    return [2] + [1000 + (i * 7919) % (vocab // 2) for i in range(length - 1)]


class MuserSide:
    def __init__(self, args: argparse.Namespace) -> None:
        # NOTE: every cell is a cold prompt: no checkpoint saved as a sequence is freed
        self.llm = LLM(args.model, max_num_seqs=1, **engine_kwargs(args) | {"prefix_cache": False})
        self.runner = self.llm.runner

    def prefill(self, ids: list[int]) -> None:
        seq = self.runner.allocate()
        self.runner.prefill(seq, ids)
        self.runner.free(seq)

    def decode(self, ids: list[int], steps: int) -> Callable[[], None]:
        """Prefill `ids`, return a function that runs `steps` greedy decode steps."""
        seq = self.runner.allocate()
        token = int(self.runner.forward([seq], [ids])[0].argmax())

        def run() -> None:
            nonlocal token
            for _ in range(steps):
                token = int(self.runner.forward([seq], [[token]])[0].argmax())
            self.runner.free(seq)
        return run


class LlamaCppSide:
    def __init__(self, path: str, threads: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(path, n_ctx=8192, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.version = llama_cpp.__version__
        self.system_info = llama_cpp.llama_print_system_info().decode().strip()

    def prefill(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(ids)

    def decode(self, ids: list[int], steps: int) -> Callable[[], None]:
        self.llm.reset()
        self.llm.eval(ids)

        def run() -> None:
            # NOTE: llama-cpp-python keeps no scores without logits_all; the context's
            # logits buffer holds the last evaluated token's row
            for _ in range(steps):
                logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(),
                                               shape=(self.llm.n_vocab(),))
                self.llm.eval([int(logits.argmax())])
        return run


def run(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    if args.repeats < 1 or args.decode_tokens < 1 or min(lengths) < 1:
        raise MuserError("--repeats, --decode-tokens and every prompt length must be >= 1")
    threads = args.threads or os.cpu_count() or 1
    sides = {"muser": MuserSide(args)}
    llm = sides["muser"].llm
    if max(lengths) + args.decode_tokens >= llm.config.max_model_len:
        raise MuserError("prompt length + decode tokens exceed --max-model-len")
    if not args.no_llama_cpp:
        try:
            sides["llama.cpp"] = LlamaCppSide(str(llm.path), threads)
        except ImportError:
            print("llama-cpp-python is not installed: measuring muser alone")
    vocab = llm.model_config.vocab_size
    load_before = os.getloadavg()  # NOTE: a shared machine's other work shows here
    cells = [("prefill", n) for n in lengths] + [("decode", 32)]
    results = []
    bar = tqdm(total=len(cells) * len(sides), desc="bench", unit="cell")
    for regime, n in cells:
        ids = _prompt(vocab, n)
        cell = {"name": f"{regime}_{n}" if regime == "prefill" else
                f"decode_{args.decode_tokens}_after_{n}", "regime": regime, "prompt_tokens": n}
        for side in sides.values():
            side.prefill(_prompt(vocab, 8))  # warm-up
        if regime == "prefill":
            runs = _rates(n, {name: lambda s=side, p=ids: lambda: s.prefill(p)
                              for name, side in sides.items()}, args.repeats)
        else:  # each run decodes from a fresh prefill of the prompt (set up untimed)
            runs = _rates(args.decode_tokens,
                          {name: lambda s=side, p=ids: s.decode(p, args.decode_tokens)
                           for name, side in sides.items()}, args.repeats)
        for name, rates in runs.items():
            cell[f"{name}_tokens_per_s"] = statistics.median(rates)
            cell[f"{name}_runs"] = rates
        bar.update(len(sides))
        if "llama.cpp" in sides:
            cell["ratio_vs_llama_cpp"] = cell["muser_tokens_per_s"] / cell["llama.cpp_tokens_per_s"]
        results.append(cell)
    bar.close()
    receipt = {
        "machine": _machine(llm.config.device, threads, sides.get("llama.cpp"))
        | {"load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()}},
        "versions": {"torch": torch.__version__,
                     "llama_cpp": getattr(sides.get("llama.cpp"), "version", None)},
        "model": str(llm.path), "dtype": llm.config.dtype, "kv_dtype": llm.config.kv_dtype,
        "prefill_chunk": llm.config.prefill_chunk, "repeats": args.repeats,
        "decode_tokens": args.decode_tokens, "cells": results,
    }
    _print_table(results, "llama.cpp" in sides)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(receipt, f, indent=2)
    return 0


def _print_table(results: list[dict], with_llama: bool) -> None:
    header = f"{'cell':<24}{'muser tok/s':>14}"
    if with_llama:
        header += f"{'llama.cpp tok/s':>18}{'ratio':>8}"
    print(header)
    for cell in results:
        line = f"{cell['name']:<24}{cell['muser_tokens_per_s']:>14.1f}"
        if with_llama:
            line += f"{cell['llama.cpp_tokens_per_s']:>18.1f}{cell['ratio_vs_llama_cpp']:>8.2f}"
        print(line)
