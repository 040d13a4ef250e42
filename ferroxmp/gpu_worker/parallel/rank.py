"""The process of a tensor-parallel rank > 0: load its shard, then follow rank 0 step by
step over the step channel (parallel/step.py) until STOP.

    python -m ferroxmp.gpu_worker.parallel.rank --run-dir DIR --rank R   (started by the supervisor)

Invariants: it keeps no row state (tokens, sampler, grammar): a STEP names the rows,
positions and token ids, a LOGITS the positions lm_head runs on; it never talks to the
scheduler. On node 0 it reads page lists from the shared-memory page table (attached
untracked: only rank 0 unlinks it); on another node they arrive in the STEP. SIGTERM
keeps its default action (exit at once: it holds nothing to clean up), and so does its
supervisor's death (PR_SET_PDEATHSIG). A collective that loses a peer raises: it exits 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from typing import Optional

import numpy as np
import torch

from ferroxmp import protocol
from ferroxmp.config import ServerArgs, setup_logging, watch_parent
from ferroxmp.page_pool import PagePool
from ferroxmp.gpu_worker.attention import backend_layout, make_backend
from ferroxmp.gpu_worker.kv.pool import KVPool, pages_for_budget
from ferroxmp.gpu_worker.loader import UnsupportedModel, load_config, weight_bytes
from ferroxmp.gpu_worker.quant import resolve_mode
from ferroxmp.gpu_worker.parallel.group import Shard, build_model
from ferroxmp.gpu_worker.parallel.step import LOGITS, STEP, STOP, TICK, Channel, agree_pages, decode_step, join, rank_device

log = logging.getLogger("ferroxmp.worker")


def follow(channel: Channel, model, attn, pool: Optional[PagePool], table_shape: tuple[int, int],
           device: torch.device, parent_alive) -> int:
    hidden: Optional[torch.Tensor] = None
    to_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    with torch.inference_mode():
        while True:
            kind, data = channel.recv()
            if kind == STEP:
                triples, ids, forgotten, table = decode_step(data, table_shape)
                for row in forgotten:
                    attn.forget(row)
                plan = attn.plan(triples, pool.page_table if table is None else table)
                hidden = model.forward(to_dev(ids), to_dev(plan.positions), attn)
            elif kind == LOGITS:
                model.logits(hidden[to_dev(data)])  # this rank's vocab shard joins the gather
            elif kind == TICK:
                if not parent_alive():
                    log.warning("the supervisor is gone; exiting")
                    return 1
            elif kind == STOP:
                return 0
            else:
                raise RuntimeError(f"unknown step message {kind}")


def run_follower(launch: dict, run_dir: str, rank: int) -> int:
    sa = ServerArgs.from_dict(launch["args"])
    parent_alive = watch_parent(signal.SIGTERM)  # SIGTERM's default: exit at once (nothing to clean)
    t = launch["tp"]
    per_node = t["world"] // t["nnodes"]
    torch.set_num_threads(sa.worker_threads or max(1, len(os.sched_getaffinity(0)) // per_node))
    device = rank_device(sa.device, rank % per_node)
    cfg = load_config(sa.model, sa.dtype, sa.kv_cache_dtype)
    shape = Shard(cfg, rank, t["world"]).local_config
    reserved = weight_bytes(sa.model, cfg.dtype) // t["world"] if device.type == "cuda" else 0
    num_pages = pages_for_budget(shape, sa.page_size, sa.kv_pages, sa.kv_cache_gb,
                                 sa.mem_fraction, device, reserved_bytes=reserved)
    max_model_len = min(sa.max_model_len or math.inf, cfg.max_position_embeddings)
    max_pages_per_row = math.ceil(max_model_len / sa.page_size)
    tp = join(t, rank, device, sa, cfg)
    pool: Optional[PagePool] = None
    try:
        num_pages = agree_pages(tp, num_pages, sa, cfg, max_pages_per_row)
        quantization = resolve_mode(sa.quantization, sa.model, device, sa.deterministic)  # as rank 0 does
        model, shape = build_model(sa.model, cfg, device, tp, quantization)
        kv = KVPool.for_model(shape, num_pages, sa.page_size, device, layout=backend_layout(device))
        attn = make_backend(kv, cfg.sliding_window, device, num_heads=shape.num_heads, dtype=cfg.dtype)
        tp.barrier()  # every rank loaded; rank 0 created the page pool before it loaded
        if tp.node == 0:
            pool = PagePool.attach(launch["pool_name"])
        import zmq
        ctx = zmq.Context()
        try:
            sup = ctx.socket(zmq.PUSH)
            sup.connect(protocol.endpoints(run_dir)["supervisor"])
            sup.send(protocol.encode(protocol.Ready(name=f"worker{rank}", pid=os.getpid(),
                                                    info={"rank": rank, "device": str(device)})))
        finally:
            ctx.destroy(linger=1000)
        log.info("rank %d of %d ready (node %d, %s, %d query / %d KV heads)", rank, t["world"], tp.node,
                 device, shape.num_heads, shape.num_kv_heads)
        return follow(Channel(tp), model, attn, pool, (sa.max_running_requests, max_pages_per_row),
                      device, parent_alive)
    finally:
        if pool is not None:
            pool.close()
        tp.close()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ferroxmp.gpu_worker.parallel.rank")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--rank", type=int, required=True)
    a = p.parse_args(argv)
    with open(os.path.join(a.run_dir, "launch.json"), encoding="utf-8") as f:
        launch = json.load(f)
    setup_logging(f"worker{a.rank}", str(launch["args"].get("log_level", "info")))
    try:
        return run_follower(launch, a.run_dir, a.rank)
    except (UnsupportedModel, OSError, RuntimeError) as e:  # a lost peer, a refused model: say what
        log.error("rank %d stops: %s", a.rank, e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
