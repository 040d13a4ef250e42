"""Bridge: the frontend's ZMQ link to the scheduler, and per-request routing.

One background thread owns the PULL socket: it decodes each TokenOut, records
its Stats (a heartbeat), and puts every RowOut on the queue registered for its
rid. Request threads send through `submit` / `abort`, serialised by a lock
because a zmq socket is not thread-safe. That thread also stamps the frontend's
liveness for the supervisor on every turn (at least every 0.2 s).

A late heartbeat is never a reason to fail a request: a scheduler that is slow,
paused or busy is still going to answer, and one that died is reported by the
supervisor (which waits on it) with a `Shutdown`. Only `/health` reads the
heartbeat's age.

Invariants: a RowOut for an rid nobody routes (a request that already ended,
e.g. the final answer to our own stop-string AbortReq) is dropped; a malformed
frame is logged and dropped, never kills the thread; a `Shutdown` marks the
bridge dead and wakes every routed queue with the SHUTDOWN sentinel so no
request waits for an answer that will not come (`fail_all` does the same when the
drain's grace period ends); sends never block (a scheduler
that stopped reading turns into an ApiError 503, not a hung HTTP thread).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterable, Optional

import zmq

from ferroxmp import protocol
from ferroxmp.frontend.errors import ApiError
from ferroxmp.liveness import Heartbeat
from ferroxmp.protocol import AbortReq, GenerateReq, Shutdown, Stats, TokenOut

log = logging.getLogger("ferroxmp.frontend")

SHUTDOWN = object()  # put on every routed queue when the server is going down


class Bridge:
    def __init__(self, run_dir: str, heartbeat_timeout: float = 5.0,
                 on_stats: Optional[Callable[[Stats], None]] = None, liveness: Optional[Heartbeat] = None):
        ep = protocol.endpoints(run_dir)
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(ep["frontend"])
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 100_000)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(ep["scheduler"])
        self.heartbeat_timeout = heartbeat_timeout
        self.on_stats = on_stats
        self.liveness = liveness
        self.routes: dict[str, queue.SimpleQueue] = {}
        self.last_heartbeat: Optional[float] = None  # monotonic
        self.dead_reason: Optional[str] = None
        self._routes_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bridge-recv", daemon=True)

    # ---- state ---------------------------------------------------------------------

    @property
    def heartbeat_fresh(self) -> bool:
        """For /health only: the scheduler answered lately."""
        return (self.last_heartbeat is not None
                and time.monotonic() - self.last_heartbeat < self.heartbeat_timeout)

    @property
    def in_flight(self) -> int:
        with self._routes_lock:
            return len(self.routes)

    # ---- request threads -----------------------------------------------------------

    def submit(self, reqs: list[GenerateReq], q: queue.SimpleQueue) -> None:
        with self._routes_lock:
            for r in reqs:
                self.routes[r.rid] = q
        try:
            for r in reqs:
                self._send(r)
        except ApiError:
            self.release(r.rid for r in reqs)
            raise

    def call(self, msg, rid: str, timeout: float):
        """Send a control message answered by one RowOut for `rid`; return what arrives
        (SHUTDOWN when the server goes down). queue.Empty after `timeout`."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._routes_lock:
            self.routes[rid] = q
        try:
            self._send(msg)
            return q.get(timeout=timeout)
        finally:
            self.release([rid])

    def abort(self, rid: str, finish_reason: str = "abort") -> None:
        try:
            self._send(AbortReq(rid=rid, finish_reason=finish_reason))
        except ApiError as e:
            log.warning("rid=%s: could not send AbortReq(%s): %s", rid, finish_reason, e.message)

    def release(self, rids: Iterable[str]) -> None:
        with self._routes_lock:
            for rid in rids:
                self.routes.pop(rid, None)

    def _send(self, msg) -> None:
        if self.dead_reason is not None:
            raise ApiError(503, f"the server is shutting down ({self.dead_reason})", code="shutting_down")
        data = protocol.encode(msg)
        with self._send_lock:
            try:
                self.push.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise ApiError(503, "the scheduler is not accepting requests; retry later",
                               code="scheduler_unavailable") from None

    # ---- receiver thread -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self._stop.is_set():
            if self.liveness is not None:
                self.liveness.beat()
            if not poller.poll(50):  # close() joins this thread: a short wait makes a stop quick
                continue
            try:
                msg = protocol.decode(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except protocol.ProtocolError as e:
                log.error("dropped a malformed frame from the scheduler: %s", e)
                continue
            try:
                self._dispatch(msg)
            except Exception:  # a bug here must not silence every later request
                log.exception("bridge: failed to dispatch %s", type(msg).__name__)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, TokenOut):
            self.last_heartbeat = time.monotonic()
            if msg.stats is not None and self.on_stats is not None:
                self.on_stats(msg.stats)
            with self._routes_lock:
                targets = [(self.routes.get(o.rid), o) for o in msg.outs]
            for q, out in targets:
                if q is not None:
                    q.put(out)
        elif isinstance(msg, Shutdown):
            log.error("shutdown requested by the supervisor: %s", msg.reason or "no reason given")
            self.fail_all(msg.reason or "a server process stopped")
        else:
            log.warning("frontend ignores unexpected %s message", type(msg).__name__)

    def fail_all(self, reason: str) -> None:
        """No answer will come: every routed request ends with an error now."""
        self.dead_reason = reason
        with self._routes_lock:
            waiting = {id(q): q for q in self.routes.values()}
        for q in waiting.values():
            q.put(SHUTDOWN)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self.pull.close(linger=0)
        self.push.close()
        self.ctx.term()
