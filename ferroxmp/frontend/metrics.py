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

from ferroxmp.protocol import GRAMMAR_COMPILE_BUCKETS, KV_SECONDS_BUCKETS, KVTierStats, Stats

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
    ("batches", "steps", "Batches sent to the worker: a step of the running rows each (several steps each "
     "under --decode-steps, a verify under speculation)."),
    ("grammar_cache_hits", "grammar_cache_hits", "Constrained requests whose grammar was compiled already."),
    ("grammar_cache_misses", "grammar_cache_misses", "Constrained requests whose grammar was compiled for them."),
    ("spec_draft_tokens", "spec_draft_tokens", "Draft tokens verified (--speculative-ngram, --draft-model)."),
    ("spec_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted (--speculative-ngram, --draft-model): tokens "
     "emitted without a step of their own."),
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
        yield _histogram("ferroxmp_grammar_compile_seconds", "Seconds to compile a request's grammar (off the "
                         "batch loop).", GRAMMAR_COMPILE_BUCKETS, stats.grammar_compile_counts,
                         stats.grammar_compile_seconds)
        yield from _tier_metrics(stats)


def _histogram(name: str, doc: str, bounds, counts, total_s: float) -> HistogramMetricFamily:
    """A histogram from per-bucket counts (the last for +Inf) counted in another process."""
    counts = list(counts) or [0] * (len(bounds) + 1)
    cumulative, total = [], 0
    for bound, n in zip([repr(float(b)) for b in bounds] + ["+Inf"], counts):
        total += n
        cumulative.append((bound, total))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total_s)


def _tier_metrics(stats: Stats):
    """KV tiers (--kv-host-gb, --kv-cache-dir): hits per tier from the scheduler, the
    rest as the worker last reported it."""
    hits = CounterMetricFamily("ferroxmp_kv_tier_hit_tokens", "Prompt tokens adopted from the prefix cache, by "
                               "the tier they were in (host/disk: loaded back into the pool first).", labels=["tier"])
    for tier in ("pool", "host", "disk"):
        hits.add_metric([tier], getattr(stats, "kv_hit_tokens_" + tier))
    yield hits
    w = stats.kv_tiers or KVTierStats()
    held = GaugeMetricFamily("ferroxmp_kv_tier_bytes", "Bytes of KV pages held below the pool, by tier.",
                             labels=["tier"])
    held.add_metric(["host"], w.host_bytes)
    held.add_metric(["disk"], w.disk_bytes)
    yield held
    yield GaugeMetricFamily("ferroxmp_kv_disk_usage_bytes", "Bytes of page files in the disk tier's directory.",
                            value=w.disk_bytes)
    yield GaugeMetricFamily("ferroxmp_kv_store_queue_depth", "Pages waiting for the disk writer.",
                            value=w.store_queue)
    for name, value, doc in (("kv_store_dropped", w.stores_dropped, "Page saves dropped (full queue or failed "
                              "write; never a blocked step)."),
                             ("kv_load_failures", w.load_failures, "Pages that could not be loaded back (missing, "
                              "torn, checksum): recomputed."),
                             ("kv_loaded_bytes", w.loaded_bytes, "Bytes loaded back into the pool."),
                             ("kv_stored_bytes", w.stored_bytes, "Bytes written to the disk tier.")):
        yield CounterMetricFamily("ferroxmp_" + name, doc, value=value)
    yield _histogram("ferroxmp_kv_load_seconds", "Seconds to load one request's pages back into the pool.",
                     KV_SECONDS_BUCKETS, w.load_counts, w.load_seconds)
    yield _histogram("ferroxmp_kv_store_seconds", "Seconds to write one page to the disk tier.",
                     KV_SECONDS_BUCKETS, w.store_counts, w.store_seconds)


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
