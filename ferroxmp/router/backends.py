"""Backends: each ferroxmp server behind the router, its health and its load.

A poller thread reads every backend's GET /health and GET /metrics each
`interval` seconds. A backend is routable iff its last /health answered 200;
a failed connection from a request marks it dead at once (the poller brings
it back once /health answers 200 again). A dead backend's PrefixTree is
cleared: a server that died or drained comes back with an empty cache.

Load is max(requests the router has in flight there, running + waiting from
its last /metrics): the router's count is exact and immediate but blind to
other clients, the server's gauges see everyone but lag by a poll.
"""
from __future__ import annotations

import http.client
import logging
import threading
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

from ferroxmp.router.tree import PrefixTree

log = logging.getLogger("ferroxmp.router")


@dataclass
class Backend:
    url: str
    tree: PrefixTree
    healthy: bool = False
    in_flight: int = 0
    running: float = 0.0  # ferroxmp_requests_running at the last poll
    waiting: float = 0.0  # ferroxmp_requests_waiting at the last poll
    routed: int = 0
    last_error: Optional[str] = None
    metrics_status: int = 200  # of the last /metrics poll
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url.rstrip("/"))
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"backend {self.url!r} must be http://HOST:PORT")
        self.host, self.port, self.prefix = parts.hostname, parts.port, parts.path

    @property
    def load(self) -> float:
        return max(self.in_flight, self.running + self.waiting)

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.routed += 1

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def mark_dead(self, reason: str) -> None:
        if self.healthy:
            log.warning("backend %s is down: %s", self.url, reason)
        self.healthy, self.last_error = False, reason
        self.tree.clear()

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def check_integrity(self) -> None:
        assert self.in_flight >= 0, (self.url, self.in_flight)
        self.tree.check_integrity()


def parse_gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Unlabelled samples `name value` of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value.split()[0])
    return out


@dataclass
class BackendPool:
    backends: list[Backend]
    interval: float = 1.0
    timeout: float = 2.0
    api_key: Optional[str] = field(default=None, repr=False)  # sent on every poll (a keyed backend's /metrics)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def _get(self, b: Backend, path: str) -> tuple[int, bytes]:
        conn = b.connection(self.timeout)
        try:
            conn.request("GET", b.prefix + path,
                         headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def poll(self, b: Backend) -> None:
        try:
            status, _ = self._get(b, "/health")
            if status != 200:
                b.mark_dead(f"/health answered {status}")
                return
            status, text = self._get(b, "/metrics")
            gauges = parse_gauges(text.decode(errors="replace"),
                                  ("ferroxmp_requests_running", "ferroxmp_requests_waiting"))
            if status != 200 and b.metrics_status != status:
                # Healthy but its load unknown (a keyed backend without the key: 401): the
                # router's own in-flight count stands in; said once, not every poll.
                log.warning("backend %s: /metrics answered %d; its load is the router's count only "
                            "(a backend with --api-key needs the router's --backend-api-key)", b.url, status)
            b.metrics_status = status
        except (OSError, http.client.HTTPException, ValueError) as e:
            b.mark_dead(f"{type(e).__name__}: {e}")
            return
        b.running = gauges.get("ferroxmp_requests_running", 0.0)
        b.waiting = gauges.get("ferroxmp_requests_waiting", 0.0)
        if not b.healthy:
            log.info("backend %s is up", b.url)
        b.healthy, b.last_error = True, None

    def poll_all(self) -> None:
        for b in self.backends:
            self.poll(b)

    def start(self) -> None:
        self.poll_all()  # routable backends are known before the first request
        threading.Thread(target=self._loop, name="poller", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll_all()

    def stop(self) -> None:
        self._stop.set()
