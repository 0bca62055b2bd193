"""W3 chat and W4 agent for bench/serve_bench.py: conversations whose every turn resends the
whole history, sent over HTTP with idle gaps between a conversation's turns, and the fields of
their receipt cells.

A conversation starts with the shared prefix (W3: a system prompt; W4: a tool preamble), then
each turn appends its new tokens (user text; a tool result) to everything before it, the
model's earlier answers included, and asks for a fixed number of tokens out:

    turn 1   shared + new_1
    turn 2   shared + new_1 + answer_1 + new_2
    turn t   shared + (new_i + answer_i for i < t) + new_t

Ids are seeded random ids in [10, 1000) (serve_receipt.random_prompts); the answers are the
ids the server streamed (llama.cpp's /completion, whose chunks carry each token's id), so a
turn begins with exactly the tokens the server computed for the turn before, as a chat client
whose text round-trips through the tokenizer would send. `concurrency` conversations run at
once (the next starts as one ends); between two turns of one conversation it sleeps an idle gap
drawn from an exponential distribution of mean `gap_s` (seeded; 0: none).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass

from serve_receipt import Stream, pct, random_prompts, summarize


@dataclass(frozen=True, slots=True)
class Dialogue:
    """One multi-turn workload's shape."""

    name: str  # "W3" | "W4"
    conversations: int
    turns: int
    shared_tokens: int  # the prefix every conversation starts with
    turn_tokens: int  # new tokens each turn
    output_tokens: int  # max_tokens of every turn (ignore_eos)
    concurrency: int  # conversations in flight at once
    gap_s: float  # mean idle seconds between two turns of a conversation
    seed: int

    def shared(self) -> list[int]:
        return random_prompts(self.seed, [self.shared_tokens])[0]

    def new_ids(self) -> list[list[list[int]]]:
        """[conversation][turn] -> the turn's new ids."""
        flat = random_prompts(self.seed + 1, [self.turn_tokens] * self.conversations * self.turns)
        return [flat[c * self.turns:(c + 1) * self.turns] for c in range(self.conversations)]

    def gaps(self) -> list[list[float]]:
        """[conversation][turn - 1] -> seconds idle before the turn (exponential, mean gap_s)."""
        rng = random.Random(self.seed + 2)
        return [[rng.expovariate(1 / self.gap_s) if self.gap_s > 0 else 0.0
                 for _ in range(self.turns - 1)] for _ in range(self.conversations)]

    def fields(self) -> dict:
        return {"conversations": self.conversations, "turns": self.turns,
                "shared_tokens": self.shared_tokens, "turn_tokens": self.turn_tokens,
                "output_tokens_per_turn": self.output_tokens, "gap_mean_s": self.gap_s,
                "gap_distribution": "exponential", "seed": self.seed}


# ---------------------------------------------------------------- over HTTP
async def send_turn(http, ids: list[int], rec: Stream) -> list[int]:
    """One streamed /completion request (greedy, ignore_eos) -> the answer's ids; `rec` fills
    in as chunks arrive (its `cached`: the final chunk's timings.cache_n)."""
    rec.sent = time.perf_counter()
    answer: list[int] = []
    body = {"prompt": ids, "n_predict": rec.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    try:
        async with http.stream("POST", "/completion", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                if event.get("stop"):
                    rec.usage, rec.cached = event["tokens_predicted"], event["timings"]["cache_n"]
                elif event["tokens"]:
                    rec.stamps.append(time.perf_counter())
                    answer += event["tokens"]
    except Exception as exc:  # noqa: BLE001  (whatever one request raises is its error)
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    return answer


async def run_dialogue(url: str, key: str, d: Dialogue, timeout: float
                       ) -> tuple[list[list[Stream]], float, str, str]:
    """Every conversation's turns in order, `d.concurrency` conversations at once, after a
    warm-up request -> the streams [turn][conversation], the wall seconds from the first send
    to the last end, and the /metrics pages before and after.
    A failed turn ends its conversation (there is no answer to resend): its later turns are
    streams that were never sent, with an error; so are those still running after `timeout`."""
    import httpx

    shared, new, gaps = d.shared(), d.new_ids(), d.gaps()
    recs: list[list[Stream | None]] = [[None] * d.conversations for _ in range(d.turns)]
    sem = asyncio.Semaphore(d.concurrency)

    async def conversation(http, c: int) -> None:
        async with sem:
            history = list(shared)
            for t in range(d.turns):
                if t:
                    await asyncio.sleep(gaps[c][t - 1])
                history += new[c][t]
                rec = recs[t][c] = Stream(len(history), d.output_tokens)
                answer = await send_turn(http, history, rec)
                if not rec.ok:
                    return
                history += answer

    async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        await send_turn(http, random_prompts(d.seed + 3, [16])[0], Stream(16, 4))  # warm-up
        before = await prefix_page(http)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(conversation(http, c)) for c in range(d.conversations)]
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        wall = time.perf_counter() - t0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        after = await prefix_page(http)
    out = [[r if r is not None else Stream(0, d.output_tokens, error="not sent") for r in turn]
           for turn in recs]
    for turn in out:
        for r in turn:
            if r.error is None and not r.ok:
                r.error = f"not finished after {timeout} s"
    return out, wall, before, after


async def prefix_page(http) -> str:
    return (await http.get("/metrics")).raise_for_status().text


# ---------------------------------------------------------------- the cell's fields
_COUNTER = re.compile(r"^(muser_prefix_cache_\w+_total)(\{[^}]*\})? (\S+)$")


def prefix_counters(page: str) -> dict[str, float]:
    """The prefix cache's counters on a /metrics page, by name and labels
    ('muser_prefix_cache_hits_total{tier="host"}'); {} when the server has no prefix cache."""
    return {m[1] + (m[2] or ""): float(m[3])
            for m in map(_COUNTER.match, page.splitlines()) if m}


def prefix_fields(before: str, after: str) -> dict | None:
    """What the prefix cache did between two /metrics pages: lookups, hits per tier and their
    share of the lookups (hit_rate), prompt tokens reused, bytes copied to and from the host
    tier; None when the server reports no prefix cache (--no-prefix-cache)."""
    a, b = prefix_counters(before), prefix_counters(after)
    if not b:
        return None
    delta = {k: v - a.get(k, 0.0) for k, v in b.items()}
    name = "muser_prefix_cache_"
    lookups = delta.get(name + "lookups_total", 0.0)
    hits = {tier: delta.get(f'{name}hits_total{{tier="{tier}"}}', 0.0)
            for tier in ("device", "host")}
    copied = {d: delta[f'{name}host_copied_bytes_total{{direction="{d}"}}']
              for d in ("to_host", "to_device")
              if f'{name}host_copied_bytes_total{{direction="{d}"}}' in delta}
    return {"lookups": lookups, "hits": hits,
            "hit_rate": {t: h / lookups if lookups else None for t, h in hits.items()},
            "tokens_reused": delta.get(name + "tokens_reused_total", 0.0),
            "host_copied_bytes": copied or None}


def dialogue_fields(recs: list[list[Stream]], wall: float, before: str, after: str) -> dict:
    """A dialogue's cell fields: summarize()'s over every turn, turns completed, TTFT from
    turn 2 on and per turn, the prompt tokens the server found cached (its responses' cache_n;
    their share of the prompt tokens sent; the share of turns from 2 on with any) and the
    /metrics counters of its prefix cache."""
    flat = [r for turn in recs for r in turn]
    later = [r for turn in recs[1:] for r in turn]
    ttft_later = [r.ttft for r in later if r.ttft is not None]
    sent_later = [r for r in later if r.cached is not None]
    errors = [r.error for r in flat if r.error]
    prompt_tokens, cached = sum(r.prompt_tokens for r in flat), sum(r.cached or 0 for r in flat)
    return summarize(flat, wall) | {
        "turns_completed": sum(r.ok for r in flat), "prompt_tokens": prompt_tokens,
        "output_tokens": sum(r.tokens for r in flat),
        "ttft_p50_from_turn2_s": pct(ttft_later, 50), "ttft_p99_from_turn2_s": pct(ttft_later, 99),
        "ttft_p50_by_turn_s": [pct([r.ttft for r in turn if r.ttft is not None], 50)
                               for turn in recs],
        "cached_tokens": cached,
        "cached_fraction": cached / prompt_tokens if prompt_tokens else None,
        "turns_hit_from_turn2": (sum(r.cached > 0 for r in sent_later) / len(sent_later)
                                 if sent_later else None),
        "prefix": prefix_fields(before, after),
    } | ({"first_error": errors[0]} if errors else {})
