"""transformers with a static KV cache and torch.compile: the strongest transformers baseline.

Decode follows transformers' documented recipe: one StaticCache of fixed length (so no step
resizes it or recompiles), prefill eager into it, then `model.forward` compiled with
mode="reduce-overhead" (CUDA graphs) and fullgraph=True, fed one token and its cache_position
per step. Prefill compiles the forward once per prompt length (default mode). Compile time is
reported apart from the steady state.
"""

from __future__ import annotations

import statistics
import time

import torch


@torch.no_grad()
def static_compile_decode(model, ids: list[int], context: int, steps: int, say) -> dict:
    """ms/token of compiled decode after a `context`-token prompt (median of `steps`)."""
    from transformers import StaticCache

    dev = model.device
    cache = StaticCache(config=model.config, max_cache_len=context + steps + 16)
    x = torch.tensor([ids[:context]], device=dev)
    out = model(x, past_key_values=cache, cache_position=torch.arange(context, device=dev),
                use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    t0 = time.perf_counter()
    times = []
    warm = 4  # compile, then CUDA-graph record, then steady state
    for step in range(steps + warm):
        pos = torch.tensor([context + step], device=dev)
        s0 = time.perf_counter()
        logits = forward(input_ids=token, past_key_values=cache, cache_position=pos,
                         use_cache=True).logits
        token = logits[:, -1:].argmax(-1).clone()
        token.item()
        if step == warm - 1:
            compile_s = time.perf_counter() - t0
            say(f"  transformers static+compile decode: warm after {compile_s:.1f} s")
        if step >= warm:
            times.append(time.perf_counter() - s0)
    return {"decode_s": statistics.median(times), "compile_s": compile_s}


def compiled_prefill_calls(model, ids: list[int], lengths: list[int], say) -> dict:
    """Compile the forward once per prompt length (default mode, static shapes; no cache kept)
    -> {length: a call running that compiled forward}."""
    dev = model.device
    forward = torch.compile(model.forward, dynamic=False)
    calls = {}
    for t in lengths:
        x = torch.tensor([ids[:t]], device=dev)

        @torch.no_grad()
        def call(x=x):
            forward(input_ids=x, use_cache=False, logits_to_keep=1)

        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        say(f"  transformers compiled prefill {t}: compiled in {time.perf_counter() - t0:.1f} s")
        calls[t] = call
    return calls


def compiled_prefill(model, ids: list[int], lengths: list[int], say, reps: int = 7) -> dict:
    """Seconds per prompt of each length through a compiled forward (median of `reps`)."""
    out = {}
    for t, call in compiled_prefill_calls(model, ids, lengths, say).items():
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            s0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - s0)
        out[t] = statistics.median(times)
        say(f"  transformers compiled prefill {t}: {out[t] * 1e3:.1f} ms")
    return out
