"""The frontend process: waitress serving the Flask app, and its lifecycle.

`python -m ferroxmp.frontend.server --run-dir DIR` reads DIR/launch.json
({"args", "worker_info", "pids"}) and, when it says "secrets_on_stdin", the API
key from a JSON object on stdin (the supervisor's pipe: no secret on disk), and
calls `run_frontend`. HTTP runs on a background thread; the main thread only
watches for the ways the process ends:

- SIGTERM / SIGINT: drain. New requests get 503, running ones finish (up to
  args["shutdown_grace"] seconds), exit 0; those still running then end with an
  error (an SSE error event, or a 503). A second signal exits at once.
- Shutdown from the supervisor (another process died): every in-flight request
  ends with an error, then exit 1.
- The parent (supervisor) dies: PR_SET_PDEATHSIG and a getppid() poll, exit 1,
  and the run directory is removed (nobody else is left to).

Connections: idle and slow clients cost memory, not service. waitress keeps every
connection in one poll loop; its cap (`connection_limit`, beyond which it stops
accepting — the old 1,024 cap denied service) is set from the file-descriptor
limit, raised to the hard limit. Threads serve only requests whose headers are in.
waitress accepts one connection per loop turn, and a turn costs O(open
connections), so a burst of 2,000 took 23 s to accept while everyone waited;
`_accept_in_bursts` drains the backlog each turn instead (0.1 s).

Invariant: the supervisor hears `Ready(name="frontend", info={"port"})` only
after the HTTP socket is bound and listening.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from typing import Optional

import waitress
import zmq

from ferroxmp import protocol
from ferroxmp.config import setup_logging, watch_parent
from ferroxmp.frontend.app import create_app
from ferroxmp.frontend.bridge import Bridge
from ferroxmp.frontend.metrics import Metrics
from ferroxmp.frontend.state import FrontendState
from ferroxmp.frontend.text.tokenizer import TextCodec
from ferroxmp.heap import release_freed_memory, settle_after_start
from ferroxmp.liveness import Heartbeat, remove_if_orphaned
from ferroxmp.wakeup import Sleeper

log = logging.getLogger("ferroxmp.frontend")

_WATCH_S = 0.05  # the main loop's turn where no signal can end it (Sleeper's fallback)
_TURN_S = 0.25  # the main loop's turn: a signal (SIGTERM, the parent's death) ends it at once
_TRIM_IDLE_S = 0.5  # no request in flight this long: the heap's free pages go back (the worker's idle too)
_SHUTDOWN_FLUSH_S = 2.0  # in-flight requests write their error; the supervisor waits 3 s for us
_FD_RESERVE = 256  # descriptors kept for zmq, the tokenizer, logs
_MAX_CONNECTIONS = 65536


def _connection_limit() -> int:
    """Raise the descriptor limit to the hard limit; every client connection holds one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return max(64, min(_MAX_CONNECTIONS, soft - _FD_RESERVE))


_ACCEPT_BURST = 512


def _accept_in_bursts(server) -> None:
    """Let one readable event on the listening socket accept every pending connection
    (up to _ACCEPT_BURST), not just one."""
    accept_one = getattr(server, "handle_accept", None)
    conns = getattr(server, "_map", None)
    if accept_one is None or conns is None:
        return  # several listening sockets (MultiSocketServer): keep waitress's own

    def handle_accept() -> None:
        for _ in range(_ACCEPT_BURST):
            before = len(conns)
            accept_one()  # adds a channel to the map, or returns having accepted nothing
            if len(conns) == before or not server.readable():
                return

    server.handle_accept = handle_accept


def _send_ready(run_dir: str, port: int) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(protocol.endpoints(run_dir)["supervisor"])
    s.send(protocol.encode(protocol.Ready(name="frontend", pid=os.getpid(), info={"port": port})))
    s.close()


def _wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def run_frontend(args: dict, run_dir: str, worker_info: dict, pids: dict) -> int:
    """Serve until drained (0), told to shut down (1) or orphaned (1)."""
    parent = os.getppid()
    watch_parent(signal.SIGHUP)
    connections = _connection_limit()
    import prometheus_client
    prometheus_client.disable_created_metrics()

    signals = {"term": 0, "parent_gone": False}

    def on_term(signum, frame):
        signals["term"] += 1

    def on_hup(signum, frame):
        if os.getppid() != parent:
            signals["parent_gone"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, on_hup)

    codec = TextCodec(args["model"], gguf_in_child=True)  # before any thread: it forks
    metrics = Metrics(int(worker_info.get("num_pages") or 0))
    bridge = Bridge(run_dir, on_stats=metrics.update_stats, liveness=Heartbeat(run_dir, "frontend"))
    state = FrontendState(args=args, worker_info=worker_info, pids=pids, codec=codec, bridge=bridge,
                          metrics=metrics)
    threads = int(args.get("http_threads") or 64)
    server = waitress.create_server(
        create_app(state), host=args.get("host") or "127.0.0.1", port=int(args.get("port") or 0),
        threads=threads, connection_limit=connections, backlog=2048,
        channel_request_lookahead=1,  # keeps reading while a request runs, so a disconnect is seen
        asyncore_use_poll=True, ident="ferroxmp", clear_untrusted_proxy_headers=True)
    _accept_in_bursts(server)
    # Started after waitress's --http-threads workers: a stack dump (liveness.py's SIGUSR1,
    # when the supervisor finds this process silent) lists the newest threads first and
    # stops at 100, so the bridge's receive loop, the usual suspect, must be among the newest.
    bridge.start()
    port = int(server.effective_port)
    threading.Thread(target=server.run, name="http", daemon=True).start()
    log.info("frontend serving %s on http://%s:%d (%d threads, up to %d connections)", state.model_name,
             args.get("host"), port, threads, connections)
    _send_ready(run_dir, port)

    settle_after_start()  # the tokenizer's build and the app's setup
    code = 0
    last_busy: Optional[float] = None  # when a request was last seen in flight (None: trimmed since)
    sleeper = Sleeper(_WATCH_S)  # 4 Python wake-ups a second instead of 20 (wakeup.Sleeper says why)
    try:
        while True:
            sleeper.wait(_TURN_S, [])
            if state.in_flight:
                last_busy = time.monotonic()
            elif last_busy is not None and time.monotonic() - last_busy > _TRIM_IDLE_S:
                release_freed_memory()  # a load's buffers go back to the OS, once per idle spell
                last_busy = None
            if signals["parent_gone"] or os.getppid() != parent:
                log.error("the supervisor (pid %d) is gone; exiting", parent)
                code = 1
                break
            if bridge.dead_reason is not None:
                _wait_until(lambda: state.in_flight == 0, _SHUTDOWN_FLUSH_S)
                code = 1
                break
            if signals["term"]:
                state.draining = True
                grace = float(args.get("shutdown_grace") or 0.0)
                log.info("draining: %d request(s) in flight, up to %.0f s", state.in_flight, grace)
                _wait_until(lambda: state.in_flight == 0 or signals["term"] > 1
                            or bridge.dead_reason is not None, grace)
                code = 1 if bridge.dead_reason is not None else 0
                if state.in_flight:
                    log.warning("the grace period ended: %d request(s) still in flight end with an error",
                                state.in_flight)
                    bridge.fail_all("the shutdown grace period ended")
                    _wait_until(lambda: state.in_flight == 0, _SHUTDOWN_FLUSH_S)
                break
    finally:
        sleeper.close()
        try:
            server.close()
        except Exception:  # the loop thread may be mid-poll; the process is exiting anyway
            pass
        bridge.close()
    return code


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ferroxmp.frontend.server")
    parser.add_argument("--run-dir", required=True)
    ns = parser.parse_args(argv)
    parent = os.getppid()
    with open(os.path.join(ns.run_dir, "launch.json"), encoding="utf-8") as f:
        launch = json.load(f)
    setup_logging("frontend", str(launch["args"].get("log_level") or "info"))
    args = dict(launch["args"])
    if launch.get("secrets_on_stdin"):
        args.update(json.loads(sys.stdin.read() or "{}"))
    try:
        code = run_frontend(args, ns.run_dir, launch["worker_info"], launch.get("pids") or {})
    except Exception:
        logging.getLogger("ferroxmp.frontend").exception("frontend failed")
        code = 1
    remove_if_orphaned(ns.run_dir, parent)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # waitress and zmq threads must not keep a finished process alive


if __name__ == "__main__":
    main()
