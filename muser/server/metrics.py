"""Prometheus metrics: per-route requests and errors, TTFT/TPOT, tokens, per-work-class queues,
KV pages and memory by category; llama-server's `llamacpp:` families beside them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from muser.core import SpecStats
from muser.kvcache.prefix import HostTierStats, PrefixStats
from muser.server.llama_metrics import LlamaTotals, render_llama
from muser.server.loop_stats import LoopStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    """Reads the engine loop's latest snapshot at scrape time."""

    def __init__(self, stats: Callable[[], LoopStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        depth = GaugeMetricFamily("muser_queue_depth", "Requests waiting, per work class",
                                  labels=["work_class"])
        steps = CounterMetricFamily("muser_steps", "Engine steps, per kind: decode rows only, "
                                    "prefill rows only, or mixed", labels=["kind"])
        rows = CounterMetricFamily("muser_scheduled_rows", "Rows run, per work class",
                                   labels=["work_class"])
        for work_class in ("decode", "prefill"):
            depth.add_metric([work_class], s.queue_depth[work_class])
            rows.add_metric([work_class], s.rows[work_class])
        for kind, count in s.steps.items():
            steps.add_metric([kind], count)
        yield from (depth, steps, rows)
        yield CounterMetricFamily("muser_preemptions", "Sequences whose KV was dropped for "
                                  "pages (recomputed later)", s.preemptions)
        yield GaugeMetricFamily("muser_live_requests", "Requests in the engine", len(s.slots))
        yield GaugeMetricFamily("muser_free_sequence_slots", "Free sequence slots",
                                s.num_free_seqs)
        yield GaugeMetricFamily("muser_free_kv_pages", "Free KV pages (cached prefix pages "
                                "included: they are evicted when needed)", s.num_free_pages)
        if s.prefix is not None:
            yield from _prefix_metrics(s.prefix)
        if s.disagg is not None:
            yield from _disagg(s.disagg)
        if s.speculation is not None:
            yield from _speculation(s.speculation)
        if s.memory is None:
            return
        yield GaugeMetricFamily("muser_kv_pages", "KV pages in the pool", s.memory.num_pages)
        held = GaugeMetricFamily("muser_memory_bytes", "Bytes held on the device, per category "
                                 "(workspace: measured on the GPU, estimated on the CPU)",
                                 labels=["category"])
        for category, nbytes in s.memory.categories().items():
            held.add_metric([category], nbytes)
        yield held


def _speculation(s: SpecStats) -> Iterator[Metric]:
    yield CounterMetricFamily("muser_spec_decode_verify_passes", "Verify passes: a sequence's "
                              "decode row and its drafts in one step", s.verified)
    yield CounterMetricFamily("muser_spec_decode_draft_tokens", "Draft tokens verified",
                              s.drafted)
    yield CounterMetricFamily("muser_spec_decode_accepted_tokens", "Draft tokens accepted "
                              "(outputs that came from a draft)", s.accepted)
    by_position = CounterMetricFamily("muser_spec_decode_accepted_tokens_per_position",
                                      "Draft tokens accepted, per position in the draft "
                                      "(0: the first)", labels=["position"])
    for i, count in enumerate(s.by_position):
        by_position.add_metric([str(i)], count)
    yield by_position


def _prefix_metrics(p: PrefixStats) -> Iterator[Metric]:
    yield CounterMetricFamily("muser_prefix_cache_lookups", "Prompts looked up in the prefix "
                              "cache", p.lookups)
    hits = CounterMetricFamily("muser_prefix_cache_hits", "Prompts that started after a cached "
                               "prefix, per tier: host when any of it was copied back from "
                               "the host tier (--kv-host-gb)", labels=["tier"])
    hits.add_metric(["device"], p.hits - p.host_hits)
    hits.add_metric(["host"], p.host_hits)
    yield hits
    yield CounterMetricFamily("muser_prefix_cache_tokens_reused", "Prompt rows not computed: "
                              "found in the prefix cache", p.tokens_reused)
    evictions = CounterMetricFamily("muser_prefix_cache_evictions", "Cached prefix pages and "
                                    "ring checkpoints evicted, per kind and tier (from the "
                                    "device: to the host tier when there is one; from the "
                                    "host: dropped)", labels=["kind", "tier"])
    evictions.add_metric(["page", "device"], p.page_evictions)
    evictions.add_metric(["checkpoint", "device"], p.checkpoint_evictions)
    for kind, count in (p.host.evictions.items() if p.host is not None else ()):
        evictions.add_metric([kind, "host"], count)
    yield evictions
    yield GaugeMetricFamily("muser_prefix_cache_pages", "KV pages no sequence holds, kept for "
                            "their prefix", p.cached_pages)
    yield GaugeMetricFamily("muser_prefix_cache_checkpoints", "Ring checkpoints held (of "
                            "muser_prefix_cache_checkpoint_slots)", p.checkpoints)
    yield GaugeMetricFamily("muser_prefix_cache_checkpoint_slots", "Ring checkpoints the "
                            "--prefix-cache-gb store holds", p.capacity)
    if p.host is not None:
        yield from _host_tier(p.host)


def _host_tier(h: HostTierStats) -> Iterator[Metric]:
    """The prefix cache's host tier: what it holds, and the copies to and from it."""
    yield GaugeMetricFamily("muser_prefix_cache_host_bytes", "Bytes the host tier holds (of "
                            "muser_prefix_cache_host_capacity_bytes)", h.nbytes)
    yield GaugeMetricFamily("muser_prefix_cache_host_capacity_bytes", "The host tier's bound "
                            "(--kv-host-gb)", h.capacity_bytes)
    yield GaugeMetricFamily("muser_prefix_cache_host_pages", "Prefix pages the host tier "
                            "holds", h.pages)
    yield GaugeMetricFamily("muser_prefix_cache_host_checkpoints", "Ring checkpoints the host "
                            "tier holds", h.checkpoints)
    moved = CounterMetricFamily("muser_prefix_cache_host_copied_bytes", "Bytes copied between "
                                "the device and the host tier, per direction",
                                labels=["direction"])
    seconds = CounterMetricFamily("muser_prefix_cache_host_copy_seconds", "Seconds the device "
                                  "spent on those copies, per direction", labels=["direction"])
    for direction, nbytes in h.copied_bytes.items():
        moved.add_metric([direction], nbytes)
        seconds.add_metric([direction], h.copy_seconds[direction])
    yield from (moved, seconds)


class Metrics:
    def __init__(self, stats: Callable[[], LoopStats]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("muser_requests", "HTTP requests by route and status code",
                                ["route", "code"], registry=r)
        self.errors = Counter("muser_request_errors", "HTTP 4xx/5xx by route and status code",
                              ["route", "code"], registry=r)
        self.ttft = Histogram("muser_ttft_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("muser_tpot_seconds", "Time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_in = Counter("muser_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.tokens_out = Counter("muser_generation_tokens", "Tokens generated", registry=r)
        r.register(_EngineCollector(stats))
        self.stats, self.llama = stats, LlamaTotals()

    def observe_finished(self, prompt_ms: float, predicted_ms: float, num_tokens: int,
                         prompt_n: int, cache_n: int, predicted_n: int) -> None:
        """A generation's phases, prompt tokens (computed, cached) and generated tokens, for
        the llamacpp: families (once per generation)."""
        self.llama.observe(prompt_ms / 1e3, predicted_ms / 1e3, num_tokens, prompt_n, cache_n,
                           predicted_n)

    def observe_request(self, route: str, code: int) -> None:
        self.requests.labels(route, str(code)).inc()
        if code >= 400:
            self.errors.labels(route, str(code)).inc()

    def render(self) -> bytes:
        sample = self.registry.get_sample_value
        llama = render_llama(self.llama, self.stats(), sample("muser_generation_tokens_total") or 0)
        return generate_latest(self.registry) + llama


def _disagg(d: dict) -> Iterator[Metric]:
    """Prefill workers: requests per outcome, transfer bytes and seconds, what is in flight."""
    outcomes = CounterMetricFamily("muser_disagg_requests", "Requests by where their prompt "
                                   "was prefilled: remote, local_short (under the crossover) "
                                   "or a fallback to local prefill and its reason",
                                   labels=["outcome"])
    for outcome, count in d["outcomes"].items():
        outcomes.add_metric([outcome], count)
    yield outcomes
    histograms = (("muser_disagg_transfer_bytes", "bytes", "KV bytes per remote prefill"),
                  ("muser_disagg_transfer_seconds", "seconds",
                   "Seconds per remote prefill, request to verified KV"))
    for name, key, doc in histograms:
        h = d[key]
        cumulative, buckets = 0, []
        for bound, count in zip([*h["buckets"], float("inf")], h["counts"]):
            cumulative += count
            buckets.append((_le(bound), cumulative))
        yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum"])
    yield GaugeMetricFamily("muser_disagg_in_flight", "Remote prefills in flight",
                            d["in_flight"])
    up = GaugeMetricFamily("muser_disagg_worker_up", "1 when the prefill worker answered its "
                           "last request or heartbeat", labels=["worker"])
    for worker, state in d["workers"].items():
        up.add_metric([worker], 1.0 if state == "up" else 0.0)
    yield up


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
