"""The router's own Prometheus metrics, in a private registry.

Counters are observed as requests are routed; the per-backend gauges are read
from the BackendPool at scrape time, so they are what the router acts on.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _PoolCollector:
    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        gauges = (("backend_healthy", "1 if the backend is routable.", lambda b: float(b.healthy)),
                  ("backend_in_flight", "Requests the router has in flight on the backend.", lambda b: b.in_flight),
                  ("backend_load", "The load the policy sees: max(in flight, running + waiting).", lambda b: b.load),
                  ("tree_blocks", "Blocks in the backend's prefix tree.", lambda b: b.tree.size))
        for suffix, doc, value in gauges:
            family = GaugeMetricFamily("ferroxmp_router_" + suffix, doc, labels=["backend"])
            for b in self.pool.backends:
                family.add_metric([b.url], value(b))
            yield family


class RouterMetrics:
    def __init__(self, pool):
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(_PoolCollector(pool))
        self.routed = Counter("ferroxmp_router_requests", "Requests that reached each backend.",
                              ["backend"], registry=r)
        self.retries = Counter("ferroxmp_router_retries", "Requests re-sent after failing to reach a backend.",
                               registry=r)
        self.affinity_hits = Counter("ferroxmp_router_cache_affinity_hits",
                                     "Requests sent where the backend's prefix tree held their prefix.",
                                     registry=r)
        self.upstream_errors = Counter("ferroxmp_router_upstream_errors",
                                       "Requests that reached a backend which then failed them.",
                                       ["backend"], registry=r)
        for b in pool.backends:  # every backend's series exists from the start, at 0
            self.routed.labels(b.url)
            self.upstream_errors.labels(b.url)

    def render(self) -> bytes:
        return generate_latest(self.registry)
