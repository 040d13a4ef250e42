"""Metrics: the Prometheus view of the server, in a private CollectorRegistry.

Pool and queue gauges and the token/busy-time counters mirror the scheduler's
latest Stats through a custom collector, so they are exactly what the scheduler
counted (no drift from re-adding deltas, no loss when a heartbeat is skipped).
Per-request histograms and `ferroxmp_requests_total{finish_reason}` are
observed by the frontend as requests end.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ferroxmp.protocol import GRAMMAR_COMPILE_BUCKETS, Stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)

_GAUGES = (  # metric name suffix, Stats field, help
    ("kv_pages_total", "pages_total", "KV pages in the pool."),
    ("kv_pages_free", "pages_free", "KV pages with refcount 0."),
    ("kv_pages_cached", "pages_cached", "KV pages held only by the radix tree."),
    ("kv_pages_in_use", "pages_in_use", "KV pages held by at least one running row."),
    ("requests_running", "running", "Requests in the running batch."),
    ("requests_waiting", "waiting", "Requests queued for admission."),
    ("step_token_budget", "step_token_budget", "Tokens one step may hold now: --max-batch-tokens, or fewer "
     "so that a step lasts about --max-step-seconds at the measured speed."),
    ("grammar_pending", "grammar_pending", "Requests waiting for their grammar to compile (off the batch loop)."),
)
_COUNTERS = (
    ("prompt_tokens", "prompt_tokens", "Prompt tokens admitted."),
    ("generation_tokens", "generation_tokens", "Tokens generated."),
    ("cached_prompt_tokens", "cached_prompt_tokens", "Prompt tokens served from the prefix cache."),
    ("worker_busy_seconds", "worker_busy_seconds", "Seconds the worker spent computing batches."),
    ("grammar_cache_hits", "grammar_cache_hits", "Constrained requests whose grammar was compiled already."),
    ("grammar_cache_misses", "grammar_cache_misses", "Constrained requests whose grammar was compiled for them."),
)


class _StatsCollector:
    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.stats
        for suffix, attr, doc in _GAUGES:
            yield GaugeMetricFamily("ferroxmp_" + suffix, doc, value=getattr(stats, attr))
        for suffix, attr, doc in _COUNTERS:
            yield CounterMetricFamily("ferroxmp_" + suffix, doc, value=getattr(stats, attr))
        yield _compile_histogram(stats)


def _compile_histogram(stats) -> HistogramMetricFamily:
    """The worker's grammar compiles (misses only), from the scheduler's bucket counts."""
    counts = list(stats.grammar_compile_counts) or [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
    bounds = [repr(float(b)) for b in GRAMMAR_COMPILE_BUCKETS] + ["+Inf"]
    cumulative, total = [], 0
    for bound, n in zip(bounds, counts):
        total += n
        cumulative.append((bound, total))
    return HistogramMetricFamily("ferroxmp_grammar_compile_seconds", "Seconds to compile a request's grammar "
                                 "(off the batch loop).", buckets=cumulative, sum_value=stats.grammar_compile_seconds)


class Metrics:
    def __init__(self, pages_total: int = 0):
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._stats = Stats(pages_total=pages_total, pages_free=pages_total)
        self.registry.register(_StatsCollector(self))
        r = self.registry
        self.requests = Counter("ferroxmp_requests", "Requests (choices) finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("ferroxmp_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ferroxmp_inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ferroxmp_e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("ferroxmp_queue_time_seconds", "Time waiting for admission.",
                                    buckets=_LATENCY_BUCKETS, registry=r)

    @property
    def stats(self) -> Stats:
        with self._lock:
            return self._stats

    def update_stats(self, stats: Stats) -> None:
        with self._lock:
            self._stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
