"""The worker process: load the model, own the page pool's shared memory, compute batches.

    python -m ferroxmp.gpu_worker.worker --run-dir DIR   (reads DIR/launch.json:
    {"args": ServerArgs dict, "pool_name": str})

Job: create the PagePool (owner) sized from the KV budget, bind PULL at the "worker"
endpoint, PUSH results to "worker_results", PUSH Ready to "supervisor"; then execute
every ForwardBatch and answer with a BatchResult, until Shutdown. It owns no policy.

Invariants:
- The pool's shared memory is unlinked on every exit path (return, exception, SIGTERM,
  parent death).
- It exits within ~2 s of its parent dying (PR_SET_PDEATHSIG where available, and a
  getppid() check on every idle poll), never lingering as an orphan.
- A malformed frame is logged and dropped; a bad batch gets an error result, a batch
  that fails in the forward fails only its rows (`isolation.py`). Nothing a peer sends
  can kill it.
- Liveness: it beats (`liveness.Heartbeat`) on every turn of its loop, before and
  after each batch, so one forward must end within --stall-timeout. If its parent
  died, it removes the run directory on the way out.
- FERROXMP_FAULT_INJECT (tests only, `faults.py`) is read once here.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from dataclasses import dataclass
from typing import Optional

# OpenMP reads its wait policy once, when torch loads it. A thread that finishes its part
# of an op spins GOMP_SPINCOUNT rounds (~tens of microseconds) for the next op, then
# sleeps: a decode step is ~600 small ops with Python between them, and sleeping at
# once (PASSIVE) added ~10 ms to every batch-1 step (14 -> 25 ms, docs/BENCHMARKS.md
# section 18), while spinning for ever (ACTIVE, or libgomp's default 300,000 rounds
# under load) takes a core from the processes beside it (section 9). Set either to override.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")

import torch  # noqa: E402
import zmq  # noqa: E402

from ferroxmp import protocol
from ferroxmp.config import ServerArgs, setup_logging, watch_parent
from ferroxmp.heap import settle_after_start
from ferroxmp.liveness import Heartbeat, remove_if_orphaned
from ferroxmp.wakeup import drain, wake_on_signals
from ferroxmp.gpu_worker import faults
from ferroxmp.page_pool import PagePool
from ferroxmp.gpu_worker import cpu_dtype
from ferroxmp.gpu_worker.sampling.grammar_prep import GrammarPrep
from ferroxmp.gpu_worker.gpu_memory import after_load, cuda_kv_budget, measure, profile_lengths, profile_pages
from ferroxmp.gpu_worker.kv.pool import pages_for_budget
from ferroxmp.gpu_worker.kv.tiers import open_tiers
from ferroxmp.gpu_worker.loader import UnsupportedModel, load_config, resolve_device, weight_bytes
from ferroxmp.gpu_worker.runner import ModelRunner

log = logging.getLogger("ferroxmp.worker")
POLL_MS = 500


@dataclass
class Sigterm:
    """SIGTERM's handler. While the worker loads, it ends the load at once (SystemExit: the
    load's finally unlinks the pool). Once the worker is about to serve it only records the
    request, and the loop returns at its next turn (the wake-up pipe ends its poll; a step
    under way finishes first). An exception raised at an arbitrary point of serving could be
    swallowed (a finalizer that gc runs reports it and goes on) or leave a half-made object
    (a thread starting its socket) that held the exit up: a worker that kept serving after
    SIGTERM (CI, stop 42)."""
    serving: bool = False
    asked: bool = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.serving:
            raise SystemExit(0)
        self.asked = True


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_worker(args: dict, run_dir: str, pool_name: str, tp_info: Optional[dict] = None) -> int:
    sa = ServerArgs.from_dict(args)
    parent = os.getppid()
    parent_alive = watch_parent(signal.SIGTERM)
    heart = Heartbeat(run_dir, "worker")
    sigterm = Sigterm()
    signal.signal(signal.SIGTERM, sigterm)
    local_ranks = sa.tp // sa.nnodes  # tensor-parallel ranks sharing this machine's cores
    torch.set_num_threads(sa.worker_threads or max(1, _cores() // local_ranks))
    model_path = sa.model
    if model_path is None:
        from ferroxmp.tiny_model import ensure_demo_model
        model_path = ensure_demo_model()
    device = resolve_device(sa.device)
    cfg = load_config(model_path, sa.dtype, sa.kv_cache_dtype)
    dtype_reason = cpu_dtype.LAST.reason if cpu_dtype.LAST is not None else cfg.dtype_name
    emulated = device.type == "cpu" and cpu_dtype.half_is_emulated(cfg.dtype)
    log.log(logging.WARNING if emulated else logging.INFO, "serving in %s", dtype_reason)
    shape, leader = cfg, None  # --tp > 1: rank 0 of the group (parallel/step.py); its KV holds its heads only
    if sa.tp > 1:
        from ferroxmp.gpu_worker.parallel import step as tp_step
        from ferroxmp.gpu_worker.parallel.group import Shard
        shape = Shard(cfg, 0, sa.tp).local_config
    max_model_len = min(sa.max_model_len or math.inf, cfg.max_position_embeddings)
    max_pages_per_row = math.ceil(max_model_len / sa.page_size)
    pool: Optional[PagePool] = None
    ctx: Optional[zmq.Context] = None
    tiers = None
    prep: Optional[GrammarPrep] = None
    try:
        if sa.tp > 1:
            leader = tp_step.Leader(tp_step.join(tp_info, 0, device, sa, cfg))
        pool, runner = _pool_and_runner(sa, cfg, shape, model_path, pool_name, device, leader,
                                        int(max_model_len), max_pages_per_row)
        num_pages = pool.num_pages
        if leader is not None:
            leader.attach(runner.attn)  # waits until every rank loaded its shard (then they attach the pool)
        runner.faults = faults.from_env()
        if runner.device.type == "cuda":
            log.info("%s", after_load(runner.device))
        ends = protocol.endpoints(run_dir)
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(ends["worker"])
        results = ctx.socket(zmq.PUSH)
        results.connect(ends["worker_results"])
        supervisor = ctx.socket(zmq.PUSH)
        supervisor.connect(ends["supervisor"])
        info = {"num_pages": num_pages, "page_size": sa.page_size, "max_model_len": int(max_model_len),
                "max_rows": sa.max_running_requests, "max_pages_per_row": max_pages_per_row,
                "vocab_size": cfg.vocab_size, "eos_token_ids": cfg.eos_token_ids,
                "sliding_window": cfg.sliding_window, "model_type": cfg.model_type,
                "dtype": cfg.dtype_name, "dtype_reason": dtype_reason, "device": str(runner.device), "model_path": model_path, "tp": sa.tp}
        info["spec_step_tokens"] = runner.spec_step_tokens
        info["decode_steps"] = runner.decode_steps
        info["memory"] = runner.memory_info()  # weight bytes by format, KV bytes: /server_info
        tiers = open_tiers(sa, runner, model_path, _sender(ctx, ends["worker_results"]))
        if tiers is not None:
            info["kv_tiers"] = tiers.describe()
            if tiers.disk is not None:
                tiers.disk.faults = runner.faults
        sigterm.serving = True  # from here a SIGTERM is a request the loop answers
        supervisor.send(protocol.encode(protocol.Ready(name="worker", pid=os.getpid(), info=info)))
        if tiers is not None:  # the index rebuilt from disk; queued until the scheduler binds
            results.send(protocol.encode(tiers.initial_report()))
        log.info("worker ready: %s", info)
        # Compiles run on their own threads (sampling/grammar_prep.py), never in this loop; with
        # --tp only this rank samples, so only it compiles.
        prep = GrammarPrep(ctx, ends["worker_results"], lambda: runner.grammars, runner.faults)
        settle_after_start()
        return _serve(runner, pull, results, parent_alive, heart, sigterm, leader, prep, tiers)
    finally:
        if leader is not None:
            leader.stop()
        if tiers is not None:
            tiers.close()
        if prep is not None:
            prep.stop()  # its threads close their own sockets: ctx.destroy then waits for none
        if ctx is not None:
            ctx.destroy(linger=0)
        if pool is not None:
            pool.close()
            pool.unlink()
        remove_if_orphaned(run_dir, parent)


def _pool_and_runner(sa: ServerArgs, cfg, shape, model_path: str, pool_name: str, device: torch.device,
                     leader, max_model_len: int, max_pages_per_row: int) -> tuple[PagePool, ModelRunner]:
    """The shared page pool (named `pool_name`) and the runner over it. On CPU, or with
    --kv-pages, the size is known before loading. One CUDA rank loads the weights over a
    small private pool, profiles the largest step and sizes the real pool from what is
    left (gpu_memory.measure); --tp ranks agree on a size before loading, estimated."""
    runner_args = dict(device=sa.device, dtype=sa.dtype, tp=leader, deterministic=sa.deterministic,
                       cuda_graph=not sa.disable_cuda_graph, quantization=sa.quantization,
                       draft_model=sa.draft_model, draft_quantization=sa.draft_quantization,
                       fused_decode=not sa.disable_fused_decode, kv_cache_dtype=sa.kv_cache_dtype,
                       decode_steps=sa.decode_steps)
    table = dict(max_rows=sa.max_running_requests, max_pages_per_row=max_pages_per_row)
    by_memory = device.type == "cuda" and sa.kv_pages is None  # else the size is given (pages or GiB)
    if by_memory and leader is None:
        free_at_start = torch.cuda.mem_get_info(device)[0]
        lengths = profile_lengths(sa.max_batch_tokens, sa.max_running_requests, max_model_len)
        probe = PagePool.create(profile_pages(lengths, sa.page_size), **table)  # private: no one attaches
        try:
            runner = ModelRunner(model_path, probe, sa.page_size, **{**runner_args, "cuda_graph": False})
            kvb = measure(runner, lengths, free_at_start, sa.mem_fraction)
        finally:
            probe.close()
            probe.unlink()
        log.info("%s", kvb.describe())
        if kvb.pages < 2:
            raise RuntimeError(f"{kvb.describe()}: too small; raise --mem-fraction or pass --kv-pages")
        pool = PagePool.create(kvb.pages, name=pool_name, **table)
        return _unlink_on_error(pool, lambda: runner.attach_pool(pool, cuda_graph=runner_args["cuda_graph"]))
    if by_memory:
        kvb = cuda_kv_budget(shape, shape.cache_dtype, sa.page_size, sa.mem_fraction, sa.max_batch_tokens,
                             sa.max_running_requests, weight_bytes(model_path, cfg.dtype) // sa.tp, device)
        log.info("%s", kvb.describe())
        num_pages = kvb.pages
    else:
        # --draft-model: its KV takes each page too (same pages, its own tensors)
        draft = load_config(sa.draft_model, sa.dtype).kv_bytes_per_token() if sa.draft_model else 0
        num_pages = pages_for_budget(shape, sa.page_size, sa.kv_pages, sa.kv_cache_gb,
                                     sa.mem_fraction, device, draft_bytes_per_token=draft)
    if leader is not None:
        from ferroxmp.gpu_worker.parallel import step as tp_step
        num_pages = tp_step.agree_pages(leader.tp, num_pages, sa, cfg, max_pages_per_row)
    pool = PagePool.create(num_pages, name=pool_name, **table)
    return _unlink_on_error(pool, lambda: ModelRunner(model_path, pool, sa.page_size, **runner_args))


def _unlink_on_error(pool: PagePool, build) -> tuple[PagePool, ModelRunner]:
    """(pool, build()); the pool's shared memory is unlinked if build raises (the caller's
    own cleanup only sees a pool once this returns)."""
    try:
        return pool, build()
    except BaseException:
        pool.close()
        pool.unlink()
        raise


def _sender(ctx: zmq.Context, endpoint: str):
    """For a thread that reports to the scheduler: its own PUSH socket (zmq sockets are
    not thread-safe), made in that thread."""
    def make():
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return lambda msg: sock.send(protocol.encode(msg))
    return make


def _serve(runner: ModelRunner, pull: zmq.Socket, results: zmq.Socket, parent_alive, heart: Heartbeat,
           sigterm: Sigterm, leader=None, prep: Optional[GrammarPrep] = None, tiers=None) -> int:
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    wake = wake_on_signals(poller)  # a SIGTERM ends the poll at once
    busy = False  # a message came since the last idle poll
    while not sigterm.asked:
        heart.beat()
        ready = dict(poller.poll(POLL_MS))
        if wake in ready:
            drain(wake)
        if pull not in ready:
            if leader is not None:
                leader.tick()  # the other ranks wait in a broadcast: keep them (and gloo) alive
            if not parent_alive():
                log.warning("the supervisor is gone; exiting")
                return 1
            if busy:  # the first POLL_MS without a message: memory kept for speed goes back
                runner.idle()
                busy = False
            continue
        busy = True
        frame = pull.recv()
        try:
            msg = protocol.decode(frame)
        except protocol.ProtocolError as e:
            log.warning("dropped a malformed frame: %s", e)
            continue
        if isinstance(msg, protocol.ForwardBatch):
            results.send(protocol.encode(runner.execute(msg)))
            if leader is not None:
                leader.done()
        elif isinstance(msg, protocol.PrepareGrammar) and prep is not None:
            prep.submit(msg)
        elif isinstance(msg, (protocol.KVSave, protocol.KVLoad, protocol.KVFlush)) and tiers is not None:
            report = tiers.handle(msg)
            if report is not None:
                results.send(protocol.encode(report))
        elif isinstance(msg, protocol.Shutdown):
            log.info("shutdown: %s", msg.reason or "asked")
            return 0
        else:
            log.warning("dropped an unexpected %s", type(msg).__name__)
    log.info("SIGTERM: stopping")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ferroxmp.gpu_worker.worker")
    p.add_argument("--run-dir", required=True)
    a = p.parse_args(argv)
    with open(os.path.join(a.run_dir, "launch.json"), encoding="utf-8") as f:
        launch = json.load(f)
    setup_logging("worker", str(launch["args"].get("log_level", "info")))
    try:
        return run_worker(launch["args"], a.run_dir, launch["pool_name"], launch.get("tp"))
    except (UnsupportedModel, OSError, RuntimeError) as e:  # startup, or a lost tp rank: say what
        log.error("worker stops: %s", e)
        return 1


if __name__ == "__main__":
    try:
        code = main()  # everything is released by now (run_worker's finally: pool, sockets, tiers)
    except SystemExit as e:  # SIGTERM's handler, after the same finally
        code = e.code if isinstance(e.code, int) else 0
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch (~0.3 s on every stop)
