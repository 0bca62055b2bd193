"""In-process measurements for bench/serve_bench.py (no server: one GPU holds one copy of the
weights): the engine's ceilings, a workload driven through `llm.engine`, and transformers'
generate() on the same weights. Only public behaviour: LLM, engine.add_request/step,
runner.allocate/forward/free."""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

from serve_receipt import Stream, random_prompts

if TYPE_CHECKING:
    import torch


def llm_kwargs(serve_flags: list[str], chunk_policy: str) -> dict:
    """The LLM(...) keywords `muser serve` builds from the same flags (its _context)."""
    from muser.cli import build_parser
    from muser.engine_args import engine_kwargs, model_kwargs

    ns = build_parser().parse_args(["serve", *serve_flags])
    kwargs = engine_kwargs(ns) | model_kwargs(ns) | {"model": ns.model}
    for name in ("max_num_seqs", "max_batched_tokens", "decode_waiting_chunk"):
        if getattr(ns, name, None) is not None:
            kwargs[name] = getattr(ns, name)
    if chunk_policy == "fixed":
        kwargs["decode_waiting_chunk"] = kwargs["prefill_chunk"]
    return kwargs


class Timer:
    """Wall seconds of a call, the GPU synchronized before and after."""

    def __init__(self, device: str) -> None:
        import torch

        self.sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None

    def __call__(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def prefill_rate(llm, reps: int) -> dict:
    """One prefill_chunk-row chunk of a fresh sequence, median of `reps` after one warm-up."""
    runner, rows = llm.runner, llm.config.prefill_chunk
    ids = random_prompts(11, [rows])[0]
    timer, times = Timer(llm.config.device), []
    for _ in range(reps + 1):
        seq = runner.allocate()
        times.append(timer(functools.partial(runner.forward, [seq], [ids])))
        runner.free(seq)
    return {"prefill_tok_s": rows / statistics.median(times[1:]), "prefill_chunk_rows": rows,
            "prefill_samples_ms": [round(t * 1e3, 3) for t in times[1:]]}


def decode_step_ms(llm, batch: int, context: int, steps: int) -> float:
    """Median ms of runner.forward over `batch` one-row sequences (graph replay where
    captured) after `context`-token prompts prefilled in prefill_chunk rows; 3 warm-up steps."""
    runner, chunk = llm.runner, llm.config.prefill_chunk
    seqs = [runner.allocate() for _ in range(batch)]
    for seq, ids in zip(seqs, random_prompts(12, [context] * batch)):
        for start in range(0, context, chunk):
            runner.forward([seq], [ids[start:start + chunk]])
    step = functools.partial(runner.forward, seqs, [[100]] * batch)
    timer = Timer(llm.config.device)
    times = [timer(step) for _ in range(steps + 3)]
    for seq in seqs:
        runner.free(seq)
    return statistics.median(times[3:]) * 1e3


def engine_run(llm, prompts: list[list[int]], outputs: list[int], concurrency: int,
               timeout: float) -> tuple[list[Stream], float]:
    """Requests through llm.engine, `concurrency` at a time (one added as one finishes, as a
    client would send them), stepped until none is left -> token times, wall seconds."""
    from muser import SamplingParams

    engine, pending, live = llm.engine, deque(zip(prompts, outputs)), {}
    recs: list[Stream] = []
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            ids, n = pending.popleft()
            recs.append(Stream(len(ids), n, time.perf_counter()))
            req = engine.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
            live[req.uid] = recs[-1]
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"the engine did not finish the workload in {timeout} s")
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.token_id is not None:
                live[out.uid].stamps.append(now)
            if out.finished:
                live.pop(out.uid)
    return recs, time.perf_counter() - t0


def set_cap(llm, cap: int) -> None:
    """The scheduler's prefill-row cap while decodes run (decode_waiting_chunk)."""
    scheduler = llm.engine.scheduler
    if not hasattr(scheduler, "decode_waiting_chunk"):
        raise AttributeError("the engine's scheduler has no decode_waiting_chunk to sweep")
    scheduler.decode_waiting_chunk = cap


def release() -> None:
    """Free a dropped LLM: its constructor froze the objects of startup (gc.freeze)."""
    import torch

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_generate(kwargs: dict, batch: int, prompt: int, new: int, seed: int,
                attn: str) -> dict:
    """transformers generate() of `batch` `prompt`-token prompts, exactly `new` tokens each, on
    the weights LLM(**kwargs) loads (bench/hf_twin.py) -> output tok/s, or {"skipped": why}."""
    try:
        import accelerate  # noqa: F401  (hf_twin builds the model on the meta device)
        import transformers
    except ImportError as exc:
        return {"skipped": f"{exc.name} is not installed (pip install transformers accelerate)"}
    import torch
    from hf_twin import hf_twin

    from muser.config import default_dtypes
    from muser.llm import default_device

    device = kwargs.get("device") or default_device()
    dtype = getattr(torch, kwargs.get("dtype") or default_dtypes(device)[0])
    cfg, weights = dense_weights(kwargs, dtype, device)
    model = hf_twin(cfg, weights, device, dtype, attn=attn)
    ids = torch.tensor(random_prompts(seed, [prompt] * batch), device=device)

    def generate(n: int) -> None:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        assert out.shape == (batch, prompt + n), out.shape

    timer = Timer(device)
    with torch.inference_mode():
        timer(functools.partial(generate, 2))  # warm-up
        wall = timer(functools.partial(generate, new))
    return {"batch": batch, "prompt_tokens": prompt, "new_tokens": new,
            "output_tok_s": batch * new / wall, "wall_s": wall, "device": device,
            "dtype": str(dtype).removeprefix("torch."), "attn": attn,
            "transformers": transformers.__version__}


def dense_weights(kwargs: dict, dtype: torch.dtype, device: str):
    """The weights LLM(**kwargs) loads, as dense tensors (GGUF codes dequantized) ->
    (ModelConfig, ModelWeights)."""
    if kwargs["load_format"] == "dummy":
        from muser.loading.dummy import load_dummy

        loaded = load_dummy(kwargs["model_config"], dtype, device, progress=False)
    else:
        from muser.loading import load_model

        loaded = load_model(kwargs["model"], dtype, device, progress=False, pack=False)
    return loaded.config, loaded.weights
