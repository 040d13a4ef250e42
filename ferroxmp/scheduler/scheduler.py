"""The scheduler process: one poller over the frontend's and the worker's sockets.

It never blocks on the worker while there is work it could prepare: with overlap
on, batch N+1 is built and sent while the worker computes N (at most two in
flight; `--disable-overlap`: one). It sleeps in `poll` otherwise — no busy
wait. One `TokenOut` per loop turn carries every row's news; a heartbeat with
`Stats` goes out at least every second so the frontend knows it is alive.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time

import zmq

from ferroxmp.config import setup_logging, watch_parent
from ferroxmp.heap import release_freed_memory, settle_after_start
from ferroxmp.liveness import Heartbeat
from ferroxmp.wakeup import drain, wake_on_signals
from ferroxmp.protocol import (AbortReq, BatchResult, FlushCache, GenerateReq, GrammarReady, KVLoaded, KVTierReport,
                               ProtocolError, Ready, RowOut, Shutdown, TokenOut, decode, encode, endpoints)
from ferroxmp.page_pool import PagePool
from ferroxmp.scheduler.core import SchedulerConfig, SchedulerCore

log = logging.getLogger("ferroxmp.scheduler")
HEARTBEAT_S = 0.5
DEBUG_INTEGRITY = os.environ.get("FERROXMP_DEBUG_INTEGRITY") == "1"


def run_scheduler(args: dict, run_dir: str, pool_name: str, worker_info: dict) -> int:
    parent_alive = watch_parent()
    heart = Heartbeat(run_dir, "scheduler")  # stamped every loop turn (at least every HEARTBEAT_S)
    pool = PagePool.attach(pool_name, writer=True)
    core = SchedulerCore(pool, SchedulerConfig.from_launch(args, worker_info))
    # Two batches in flight: the next is planned while one computes, except behind a batch
    # whose rows may take several tokens (core.lookahead_inflight).
    max_inflight = 1 if args["disable_overlap"] else 2
    ctx = zmq.Context()
    ep = endpoints(run_dir)
    from_frontend, from_worker = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    from_frontend.bind(ep["scheduler"])
    from_worker.bind(ep["worker_results"])
    to_worker, to_frontend, to_supervisor = (ctx.socket(zmq.PUSH) for _ in range(3))
    for sock, name in ((to_worker, "worker"), (to_frontend, "frontend"), (to_supervisor, "supervisor")):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ep[name])
    poller = zmq.Poller()
    poller.register(from_frontend, zmq.POLLIN)
    poller.register(from_worker, zmq.POLLIN)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    wake = wake_on_signals(poller)  # SIGTERM ends the poll at once, not at its timeout
    to_supervisor.send(encode(Ready("scheduler", os.getpid(), {})))
    settle_after_start()
    log.info("scheduler ready: %d pages of %d tokens, max %d rows, overlap %s, radix %s",
             pool.num_pages, core.cfg.page_size, pool.max_rows, max_inflight == 2, core.cfg.radix)
    last_beat = 0.0
    worked = False  # a batch went out since the heap was last trimmed
    try:
        while not stop["now"]:
            heart.beat()
            now = time.time()
            wait_ms = max(0, int((last_beat + HEARTBEAT_S - now) * 1000))
            ready = dict(poller.poll(wait_ms))
            now = time.time()
            if wake in ready:
                drain(wake)
            if from_frontend in ready:
                stop["now"] |= _drain_frontend(from_frontend, core, now)
            if from_worker in ready:
                _drain_worker(from_worker, core, now)
            for prep in core.grammars.take_prepares():  # compiled off the worker's batch loop
                to_worker.send(encode(prep))
            core.expire(now)
            while len(core.inflight) < max_inflight and not core.lookahead_inflight:
                batch = core.build_batch(now)
                # KV saves first: they copy out pages this batch may reuse (tier_moves.py)
                for op in core.take_kv_ops():
                    to_worker.send(encode(op))
                if batch is None:
                    break
                to_worker.send(encode(batch), copy=False)
                worked = True
            for op in core.take_kv_ops():  # a flush, or loads started with no batch to send
                to_worker.send(encode(op))
            outs = core.take_outputs()
            beat = now - last_beat >= HEARTBEAT_S
            if outs or beat:
                to_frontend.send(encode(TokenOut(outs, core.stats() if beat else None)), copy=False)
                last_beat = now if beat else last_beat
            if beat and worked and core.idle:  # a load ended: its requests' pages go back to the OS
                release_freed_memory()
                worked = False
            if beat and not parent_alive():
                log.warning("supervisor is gone; exiting")
                break
    finally:
        log.info("scheduler stopping")
        pool.close()
        ctx.destroy(linger=0)
    return 0


def _messages(sock: zmq.Socket, source: str):
    """Every message queued on `sock` now; malformed frames are logged and dropped."""
    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        try:
            yield decode(frame.bytes)
        except ProtocolError as e:
            log.error("dropped a frame from the %s: %s", source, e)


def _drain_frontend(sock: zmq.Socket, core: SchedulerCore, now: float) -> bool:
    """Take every queued frontend message. True when told to shut down."""
    for msg in _messages(sock, "frontend"):
        if isinstance(msg, GenerateReq):
            try:
                refusal = core.add_request(msg, now)
            except Exception as e:  # a malformed request must not take the scheduler down
                log.exception("request %s refused: %s", msg.rid, e)
                refusal = RowOut(msg.rid, finish_reason="error", status=400, error=f"malformed request: {e}")
            if refusal is not None:
                core.outbox.refuse(refusal)
        elif isinstance(msg, AbortReq):
            core.abort(msg.rid, msg.finish_reason)
        elif isinstance(msg, FlushCache):
            core.flush_cache(msg.rid)
        elif isinstance(msg, Shutdown):
            log.info("shutdown requested: %s", msg.reason)
            return True
        else:
            log.error("unexpected %s from the frontend dropped", type(msg).__name__)
    return False


def _drain_worker(sock: zmq.Socket, core: SchedulerCore, now: float) -> None:
    for msg in _messages(sock, "worker"):
        if isinstance(msg, BatchResult):
            core.process_result(msg, now)
            if DEBUG_INTEGRITY:
                core.check_integrity()
        elif isinstance(msg, GrammarReady):
            core.grammar_ready(msg)
        elif isinstance(msg, KVLoaded):
            core.kv_loaded(msg)
        elif isinstance(msg, KVTierReport):
            core.kv_report(msg)
        else:
            log.error("unexpected %s from the worker dropped", type(msg).__name__)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ns = ap.parse_args()
    with open(os.path.join(ns.run_dir, "launch.json")) as f:
        launch = json.load(f)
    setup_logging("scheduler", launch["args"]["log_level"])
    raise SystemExit(run_scheduler(launch["args"], ns.run_dir, launch["pool_name"], launch["worker_info"]))


if __name__ == "__main__":
    main()
