"""The serving receipt's arithmetic (bench/serve_bench.py writes it, other scripts read it):
the workloads' prompts, per-request timings -> cell fields, the bound of a workload from the
ceilings, merging phases into one receipt file, and its plot. Standard library only
(matplotlib for the plot).

Receipt: {"machine": {...}, "gpu": {...} | null,
          "cells": [one per (model, workload, chunk_policy, variant)],
          "ceilings": {model: {"prefill_tok_s", "decode_step_ms": {batch: ms}, ...}},
          "cap_sweep": {model: [one row per cap]}, "hf_generate": {model: {...}}}
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """The workloads' prompts: seeded random ids in [10, 1000), valid in every Gemma 3
    vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]


def pct(values: list[float], q: float) -> float | None:
    """q-th percentile, linear between order statistics (numpy's default); None for none."""
    if not values:
        return None
    s = sorted(values)
    pos = q / 100 * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


@dataclass(slots=True)
class Stream:
    """One request as its client saw it: when it was sent, when each token chunk arrived."""

    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    stamps: list[float] = field(default_factory=list)
    usage: int | None = None  # completion_tokens of the final usage chunk, when sent
    cached: int | None = None  # prompt tokens the server found in its prefix cache, when sent
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage if self.usage is not None else len(self.stamps)

    @property
    def ok(self) -> bool:
        """Neither raised nor truncated: exactly max_tokens tokens (ignore_eos)."""
        return self.error is None and self.tokens == self.max_tokens

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.sent if self.stamps else None

    @property
    def tpot(self) -> float | None:
        """(last token time - first token time) / (tokens - 1)."""
        if len(self.stamps) < 2 or self.tokens < 2:
            return None
        return (self.stamps[-1] - self.stamps[0]) / (self.tokens - 1)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.stamps)]


def summarize(streams: list[Stream], wall: float) -> dict:
    """A workload's throughput and latency fields; total = prompt + output tokens."""
    started = [s for s in streams if s.stamps]
    out_tokens = sum(s.tokens for s in streams)
    in_tokens = sum(s.prompt_tokens for s in started)
    ttft = [s.ttft for s in started]
    tpot = [s.tpot for s in streams if s.tpot is not None]
    gaps = [g for s in streams for g in s.gaps]
    return {"output_tok_s": out_tokens / wall, "total_tok_s": (in_tokens + out_tokens) / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_ms": ms(pct(tpot, 50)), "tpot_p99_ms": ms(pct(tpot, 99)),
            "itl_p99_ms": ms(pct(gaps, 99)), "errors": sum(not s.ok for s in streams),
            "wall_s": wall}


def gap_summary(streams: list[Stream], long: Stream) -> dict:
    """Decoding streams' gaps that overlap a long prompt's prefill (its send .. its first
    token), that prompt's TTFT, and the trace (stamps from 2 s before it arrived, relative)."""
    arrive = long.sent
    done = long.stamps[0] if long.stamps else arrive
    during = [b - a for s in streams for a, b in itertools.pairwise(s.stamps)
              if b > arrive and a < done]
    gaps = [g for s in streams for g in s.gaps]
    last = max((s.stamps[-1] for s in streams if s.stamps), default=None)
    return {"long_prompt_tokens": long.prompt_tokens, "long_prompt_ttft_s": long.ttft,
            "ttft_p50_s": long.ttft, "ttft_p99_s": long.ttft,
            "gaps_during_prefill": len(during), "tpot_p50_ms": ms(pct(during, 50)),
            "tpot_p99_ms": ms(pct(during, 99)), "tpot_max_ms": ms(max(during, default=None)),
            "itl_p99_ms": ms(pct(gaps, 99)), "output_tok_s": None, "total_tok_s": None,
            "errors": sum(s.error is not None for s in streams) + (not long.ok),
            "wall_s": None if last is None else last - arrive,
            "trace": {"prefill_s": done - arrive,
                      "stamps": [[round(t - arrive, 4) for t in s.stamps if t > arrive - 2]
                                 for s in streams]}}


# ---------------------------------------------------------------- the bound
def waves(prompt_lens: list[int], output_lens: list[int], concurrency: int) -> list[dict]:
    """Requests in arrival order, `concurrency` at a time -> per wave its request, prompt-token
    and output-token counts."""
    return [{"requests": len(prompt_lens[i:i + concurrency]),
             "prompt_tokens": sum(prompt_lens[i:i + concurrency]),
             "output_tokens": sum(output_lens[i:i + concurrency])}
            for i in range(0, len(prompt_lens), concurrency)]


def step_ms_at(decode_ms: dict[int, float], batch: int) -> float | None:
    """Decode-only step ms at `batch`: measured, else linear between the measured batches
    around it; None outside them."""
    if batch in decode_ms:
        return decode_ms[batch]
    below = [b for b in decode_ms if b < batch]
    above = [b for b in decode_ms if b > batch]
    if not below or not above:
        return None
    lo, hi = max(below), min(above)
    return decode_ms[lo] + (decode_ms[hi] - decode_ms[lo]) * (batch - lo) / (hi - lo)


def bound_s(wave_list: list[dict], prefill_tok_s: float, decode_ms: dict[int, float]
            ) -> float | None:
    """Seconds a workload takes at the ceilings: per wave, its prompt tokens at the prefill
    rate, then one decode step at the wave's batch per output token of a request (the wave's
    mean when lengths differ). None when a wave's batch was not measured."""
    total = 0.0
    for w in wave_list:
        step = step_ms_at(decode_ms, w["requests"])
        if step is None:
            return None
        total += w["prompt_tokens"] / prefill_tok_s
        total += w["output_tokens"] / w["requests"] * step / 1e3
    return total


def with_bound(cell: dict, ceilings: dict | None) -> dict:
    """The cell plus decode_step_ms (at its decode_batch), bound_output_tok_s and
    fraction_of_bound; null without ceilings (and the bound for cells without waves)."""
    extra = {"decode_step_ms": None, "bound_output_tok_s": None, "fraction_of_bound": None}
    if not ceilings:
        return cell | extra
    decode_ms = {int(b): v for b, v in ceilings["decode_step_ms"].items()}
    extra["decode_step_ms"] = step_ms_at(decode_ms, cell["decode_batch"])
    seconds = None
    if cell.get("waves"):
        seconds = bound_s(cell["waves"], ceilings["prefill_tok_s"], decode_ms)
    if seconds:
        extra["bound_output_tok_s"] = sum(w["output_tokens"] for w in cell["waves"]) / seconds
        extra["fraction_of_bound"] = cell["output_tok_s"] / extra["bound_output_tok_s"]
    return cell | extra


# ---------------------------------------------------------------- the receipt file
def merge(receipt: dict, part: dict) -> dict:
    """`part` replaces the receipt's cells of the same (model, workload, chunk_policy, variant:
    W3 and W4's server flags, none for the other workloads) and the
    same models' ceilings, cap_sweep and hf_generate; the rest is kept. Every cell's bound is
    recomputed from its model's ceilings, whichever phase ran last."""
    new_keys = {cell_key(c) for c in part.get("cells", [])}
    cells = [c for c in receipt.get("cells", []) if cell_key(c) not in new_keys]
    cells += part.get("cells", [])
    out = dict(receipt)
    for name in ("machine", "gpu"):
        if name in part:
            out[name] = part[name]
    for name in ("ceilings", "cap_sweep", "hf_generate"):
        out[name] = receipt.get(name, {}) | part.get(name, {})
    out["cells"] = [with_bound(c, out["ceilings"].get(c["model"])) for c in cells]
    return out


def cell_key(cell: dict) -> tuple[str, str, str, str | None]:
    return cell["model"], cell["workload"], cell["chunk_policy"], cell.get("variant")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def cell_line(c: dict) -> str:
    """One line per cell for the log."""
    variant = f", {c['variant']}" if c.get("variant") else ""
    if "server_error" in c:
        return f"{c['model']} {c['workload']} ({c['chunk_policy']}{variant}): {c['server_error']}"
    head = f"{c['model']} {c['workload']} ({c['chunk_policy']}{variant}): {c['errors']} errors, "
    if c["workload"] == "adaptive":
        return head + (
            f"long prompt {c['long_prompt_tokens']} tok TTFT {_fmt(c['long_prompt_ttft_s'], '.3f')}"
            f" s; stream gaps during its prefill p50/p99/max {_fmt(c['tpot_p50_ms'], '.1f')}/"
            f"{_fmt(c['tpot_p99_ms'], '.1f')}/{_fmt(c['tpot_max_ms'], '.1f')} ms "
            f"({c['gaps_during_prefill']} gaps)")
    if "turns_completed" in c:
        return head + dialogue_line(c)
    return head + (
        f"{c['output_tok_s']:.1f} out tok/s ({c['total_tok_s']:.1f} total), TTFT p50/p99 "
        f"{_fmt(c['ttft_p50_s'], '.3f')}/{_fmt(c['ttft_p99_s'], '.3f')} s, TPOT p50/p99 "
        f"{_fmt(c['tpot_p50_ms'], '.1f')}/{_fmt(c['tpot_p99_ms'], '.1f')} ms, ITL p99 "
        f"{_fmt(c['itl_p99_ms'], '.1f')} ms, {c['wall_s']:.1f} s; decode-only step "
        f"{_fmt(c.get('decode_step_ms'), '.2f')} ms, {_fmt(c.get('fraction_of_bound'), '.3f')} "
        "of the bound")


def dialogue_line(c: dict) -> str:
    hit = (c["prefix"] or {}).get("hit_rate") or {}
    return (f"{c['turns_completed']}/{c['conversations'] * c['turns']} turns, "
            f"{c['output_tok_s']:.1f} out tok/s, TTFT p50/p99 {_fmt(c['ttft_p50_s'], '.3f')}/"
            f"{_fmt(c['ttft_p99_s'], '.3f')} s (p50 from turn 2 "
            f"{_fmt(c['ttft_p50_from_turn2_s'], '.3f')} s), TPOT p99 "
            f"{_fmt(c['tpot_p99_ms'], '.1f')} ms, prefix hit rate device/host "
            f"{_fmt(hit.get('device'), '.2f')}/{_fmt(hit.get('host'), '.2f')}, "
            f"{c['cached_tokens']} cached prompt tokens, {c['wall_s']:.1f} s")


# ---------------------------------------------------------------- the plot
def plot(receipt: dict, path: Path) -> None:
    """Per model: output tok/s per workload with its bound; the cap sweep's TTFT vs TPOT; the
    adaptive vs fixed gap traces."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({c["model"] for c in receipt.get("cells", [])}
                    | set(receipt.get("cap_sweep", {})) | set(receipt.get("hf_generate", {})))
    fig, axes = plt.subplots(max(1, len(models)), 3, figsize=(17, 4.6 * max(1, len(models))),
                             squeeze=False)
    for row, model in zip(axes, models):
        cells = [c for c in receipt.get("cells", []) if c["model"] == model]
        _bars(row[0], model, cells, receipt.get("hf_generate", {}).get(model))
        _sweep(row[1], model, receipt.get("cap_sweep", {}).get(model, []))
        _gaps(row[2], model, [c for c in cells if c["workload"] == "adaptive"])
    where = (receipt.get("gpu") or {}).get("name") or receipt.get("machine", {}).get("cpu")
    fig.suptitle(f"muser serve on {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _bars(ax, model: str, cells: list[dict], hf: dict | None) -> None:
    bars = [(f"{c['workload']}\n{c.get('variant') or c['chunk_policy']}", c["output_tok_s"],
             c.get("bound_output_tok_s")) for c in cells
            if c["workload"] != "adaptive" and c.get("output_tok_s") is not None]
    if hf and "output_tok_s" in hf:
        bars.append((f"HF generate\nbatch {hf['batch']}", hf["output_tok_s"], None))
    xs = range(len(bars))
    ax.bar(xs, [b[1] for b in bars], color="tab:blue")
    for x, (_, value, bound) in zip(xs, bars):
        if bound:
            ax.plot([x - 0.4, x + 0.4], [bound, bound], color="black", lw=2)
            ax.annotate(f"{value / bound:.2f} of bound", (x, bound), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [b[0] for b in bars])
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{model}: output tok/s, bound in black", fontsize=10)


def _sweep(ax, model: str, rows: list[dict]) -> None:
    for q, marker in (("p50", "o"), ("p99", "^")):
        tpot = [r[f"tpot_{q}_ms"] for r in rows]
        ttft = [r[f"ttft_{q}_s"] for r in rows]
        ax.plot(tpot, ttft, marker=marker, label=q)
        for r, x, y in zip(rows, tpot, ttft):
            ax.annotate(str(r["cap"]), (x, y), fontsize=8, xytext=(3, 3),
                        textcoords="offset points")
    ax.set(xlabel="TPOT (ms)", ylabel="TTFT (s)")
    ax.set_title(f"{model}: W1 in process per decode_waiting_chunk", fontsize=10)
    if rows:
        ax.legend()


def _gaps(ax, model: str, cells: list[dict]) -> None:
    colors = {"adaptive": "tab:blue", "fixed": "tab:red"}
    for c in cells:
        color = colors.get(c["chunk_policy"], "gray")
        for k, stamps in enumerate(c["trace"]["stamps"]):
            ax.plot(stamps[1:], [1e3 * (b - a) for a, b in itertools.pairwise(stamps)], ".",
                    color=color, ms=3, label=c["chunk_policy"] if k == 0 else None)
        ax.axvspan(0, c["trace"]["prefill_s"], color=color, alpha=0.08)
    tokens = cells[0]["long_prompt_tokens"] if cells else "?"
    ax.set(xlabel="seconds since the long prompt arrived", ylabel="inter-token gap (ms)")
    ax.set_title(f"{model}: stream gaps while a {tokens}-token prompt prefills (shaded)",
                 fontsize=10)
    if cells:
        ax.legend()
