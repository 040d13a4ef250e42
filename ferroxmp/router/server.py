"""`ferroxmp router`: build the pool, policy and app, serve with waitress until a signal.

SIGTERM / SIGINT: stop polling, wait up to --shutdown-grace for proxied
requests to finish (a second signal stops at once), exit 0.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import waitress

from ferroxmp.config import setup_logging
from ferroxmp.router.app import create_app
from ferroxmp.router.args import RouterArgs
from ferroxmp.router.backends import Backend, BackendPool
from ferroxmp.router.metrics import RouterMetrics
from ferroxmp.router.policy import make_policy
from ferroxmp.router.tree import PrefixTree

log = logging.getLogger("ferroxmp.router")


@dataclass
class RouterState:
    args: RouterArgs
    pool: BackendPool
    policy: object
    metrics: RouterMetrics

    @property
    def in_flight(self) -> int:
        return sum(b.in_flight for b in self.pool.backends)


def build_state(args: RouterArgs) -> RouterState:
    backends = [Backend(url, PrefixTree(args.block_chars, args.tree_max_blocks)) for url in args.backend]
    # The key for polling /metrics: a keyed backend refuses it without one, and the router
    # would then call a living backend dead. The flag, else the environment, else --api-key.
    key = args.backend_api_key or os.environ.get("FERROXMP_BACKEND_API_KEY") or args.api_key
    pool = BackendPool(backends, args.health_interval, args.health_timeout, api_key=key)
    policy = make_policy(args.policy, args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold)
    return RouterState(args, pool, policy, RouterMetrics(pool))


def run_router(args: RouterArgs) -> int:
    setup_logging("router", args.log_level)
    import prometheus_client
    prometheus_client.disable_created_metrics()
    state = build_state(args)
    signals = threading.Event()
    count = [0]

    def on_term(signum, frame):
        count[0] += 1
        signals.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    state.pool.start()
    server = waitress.create_server(
        create_app(state), host=args.host, port=args.port, threads=args.http_threads,
        connection_limit=max(1000, 2 * args.http_threads), backlog=2048,
        channel_request_lookahead=1,  # keeps reading while a request runs, so a disconnect is seen
        asyncore_use_poll=True, ident="ferroxmp-router")
    threading.Thread(target=server.run, name="http", daemon=True).start()
    log.info("router (%s) on http://%s:%d in front of %s; healthy: %d", state.policy.name, args.host,
             int(server.effective_port), ", ".join(args.backend), len(state.pool.healthy()))
    signals.wait()
    state.pool.stop()
    deadline = time.monotonic() + args.shutdown_grace
    while state.in_flight and count[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    if state.in_flight:
        log.warning("stopping with %d request(s) still in flight", state.in_flight)
    try:
        server.close()
    except Exception:  # the loop thread may be mid-poll; the process is exiting anyway
        pass
    return 0
