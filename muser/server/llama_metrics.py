"""llama-server's Prometheus families (`llamacpp:*`), written out by hand: their names carry no
`_total` suffix rule that prometheus_client could produce (`llamacpp:n_tokens_max` is a counter)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from muser.server.loop_stats import LoopStats


@dataclass
class LlamaTotals:
    """Sums over finished generations; any thread may observe."""

    prompt_s: float = 0.0
    predicted_s: float = 0.0
    max_tokens: int = 0
    prompt_tokens: int = 0  # computed (timings' prompt_n)
    cached_tokens: int = 0  # found in the prefix cache (timings' cache_n)
    # NOTE: the window since the last scrape, as llama-server's buckets: (prompt tokens,
    # prompt s, predicted tokens, predicted s); its two throughput gauges average over it
    bucket: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, prompt_s: float, predicted_s: float, num_tokens: int, prompt_n: int,
                cache_n: int, predicted_n: int) -> None:
        with self._lock:
            self.prompt_s += prompt_s
            self.predicted_s += predicted_s
            self.max_tokens = max(self.max_tokens, num_tokens)
            self.prompt_tokens += prompt_n
            self.cached_tokens += cache_n
            b = self.bucket
            self.bucket = (b[0] + prompt_n, b[1] + prompt_s, b[2] + predicted_n,
                           b[3] + predicted_s)

    def take_bucket(self) -> tuple[int, float, int, float]:
        """The window since the last scrape, emptied (a scrape starts the next one)."""
        with self._lock:
            bucket, self.bucket = self.bucket, (0, 0.0, 0, 0.0)
            return bucket


def render_llama(totals: LlamaTotals, stats: LoopStats, predicted_tokens: float) -> bytes:
    """Prometheus text of the llamacpp: families, for one scrape. Prompt tokens are counted as
    llama-server counts them, when a generation ends: those computed, and apart those taken
    from the prefix cache; spec_* are the engine's speculative decoding counts (0 without
    --speculative); the throughput gauges average over the generations finished since the last
    scrape (0 when none did), which this one ends."""
    decode_steps = stats.steps.get("decode", 0) + stats.steps.get("mixed", 0)
    window_prompt_n, window_prompt_s, window_predicted_n, window_predicted_s = (
        totals.take_bucket())
    busy = sum(1 for s in stats.slots if s.slot is not None)
    spec, prompt_tokens = stats.speculation, totals.prompt_tokens
    rows = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", prompt_tokens),
        ("prompt_tokens_cached_total", "counter", "Number of prompt tokens taken from the cache.",
         totals.cached_tokens),
        ("prompt_seconds_total", "counter", "Prompt process time", totals.prompt_s),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed.",
         predicted_tokens),
        ("tokens_predicted_seconds_total", "counter", "Predict process time",
         totals.predicted_s),
        ("n_decode_total", "counter", "Total number of engine steps.", sum(stats.steps.values())),
        ("n_tokens_max", "counter", "Largest observed n_tokens.", totals.max_tokens),
        ("spec_decode_num_draft_tokens_total", "counter", "Speculative draft tokens.",
         spec.drafted if spec else 0),
        ("spec_decode_num_accepted_tokens_total", "counter", "Accepted draft tokens.",
         spec.accepted if spec else 0),
        ("spec_decode_num_drafts_total", "counter", "Speculative drafts.",
         spec.verified if spec else 0),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         window_prompt_n / window_prompt_s if window_prompt_s else 0.0),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
         window_predicted_n / window_predicted_s if window_predicted_s else 0.0),
        ("requests_processing", "gauge", "Number of requests processing.", busy),
        ("requests_deferred", "gauge", "Number of requests deferred.",
         len(stats.slots) - busy),
        ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per decode step.",
         stats.rows.get("decode", 0) / decode_steps if decode_steps else 0.0),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                  f"llamacpp:{name} {float(value)}"]
    return ("\n".join(lines) + "\n").encode()
