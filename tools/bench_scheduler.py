"""Scheduler CPU time per step and admissions per step: the real SchedulerCore, a stub worker.

No model and no sockets: a stub worker answers each ForwardBatch at once with a random
token for every sampling step, so what is timed is the scheduler's own work per loop
turn — process the oldest result, take the outputs, plan the next batch(es) — exactly
the calls `scheduler.py` makes, through the core's public API only (so the same script
measures any version of the core). Two batches stay in flight, as with overlap on.

Scenarios (issue 13):
  a  256 decoding rows + 512 waiting 4k-token prompts (no row free: admission can do nothing)
  b  a warm burst of 64 requests sharing a 1k-token prefix the tree already holds
  c  1,000 short requests arriving at once
  d  rows free but the pool short: 64 decoding rows, 512 waiting 4k-token prompts, 2,000 pages
     (two prompts fit and prefill, publishing pages they still hold; the rest must wait)

    .venv/bin/python tools/bench_scheduler.py [--scenarios abcd] [--json out.json]

CPU time is the process's (time.process_time), so a busy machine inflates it less than
wall time would; it is still a shared-machine figure when other work runs.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ferroxmp.protocol import BatchResult, GenerateReq, SamplingParams, pack_ids  # noqa: E402
from ferroxmp.page_pool import PagePool  # noqa: E402
from ferroxmp.scheduler.core import SchedulerConfig, SchedulerCore  # noqa: E402

VOCAB = 32_000
PAGE = 16


class Harness:
    """The core, a stub worker, and per-turn timing."""

    def __init__(self, num_pages: int, max_rows: int, max_batch_tokens: int = 2048,
                 max_model_len: int = 8192, seed: int = 0):
        self.pool = PagePool.create(num_pages, max_rows, max_model_len // PAGE)
        self.core = SchedulerCore(self.pool, SchedulerConfig(
            page_size=PAGE, max_batch_tokens=max_batch_tokens, max_model_len=max_model_len,
            vocab_size=VOCAB, eos_token_ids=(), queue_timeout=1e9))
        self.rng = np.random.default_rng(seed)
        self.queue: deque = deque()
        self.n = 0
        self.finished = 0
        self.cpu: list[float] = []       # whole loop turn
        self.cpu_build: list[float] = []  # build_batch alone
        self.admitted: list[int] = []     # new rows per turn

    def submit(self, prompt: np.ndarray, max_tokens: int) -> str:
        rid = f"r{self.n}"
        self.n += 1
        msg = GenerateReq(rid, pack_ids(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                 ignore_eos=True), time.time())
        assert self.core.add_request(msg, time.time()) is None
        return rid

    def _answer(self, batch) -> BatchResult:
        rows = [s.row for s in batch.steps if s.sample]
        toks = self.rng.integers(10, VOCAB, len(rows))
        return BatchResult(batch.batch_id, rows=pack_ids(rows), tokens=pack_ids(toks))

    def turn(self, record: bool = True) -> bool:
        """One scheduler loop turn. False when there was nothing to do."""
        result = self._answer(self.queue.popleft()) if self.queue else None
        t0 = time.process_time()
        now = time.time()
        if result is not None:
            self.core.process_result(result, now)
        outs = self.core.take_outputs()
        tb = time.process_time()
        admitted = 0
        while len(self.queue) < 2:
            batch = self.core.build_batch(now)
            if batch is None:
                break
            admitted += len(batch.new_rows)
            self.queue.append(batch)
        t1 = time.process_time()
        self.finished += sum(1 for o in outs if o.finish_reason)
        if record and (result is not None or self.queue):
            self.cpu.append(t1 - t0)
            self.cpu_build.append(t1 - tb)
            self.admitted.append(admitted)
        return result is not None or bool(self.queue)

    def run(self, turns: int, record: bool = True) -> None:
        for _ in range(turns):
            if not self.turn(record):
                return

    def close(self) -> None:
        self.pool.close()
        self.pool.unlink()


def _ms(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    return {"median_ms": 1e3 * statistics.median(s), "p90_ms": 1e3 * s[int(0.9 * (len(s) - 1))],
            "max_ms": 1e3 * s[-1]}


def _summary(h: Harness, **extra) -> dict:
    adm = [a for a in h.admitted if a]
    return {"turns": len(h.cpu), "cpu_per_turn": _ms(h.cpu), "cpu_build_batch": _ms(h.cpu_build),
            "admissions_max_per_turn": max(h.admitted, default=0),
            "admissions_mean_when_any": (sum(adm) / len(adm)) if adm else 0.0, **extra}


def scenario_a(turns: int) -> dict:
    """256 rows decoding, 512 4k-token prompts waiting for a row that never frees up."""
    h = Harness(num_pages=16_384, max_rows=256)
    try:
        for _ in range(256):
            h.submit(h.rng.integers(10, VOCAB, 128, dtype=np.int32), 4000)
        h.run(64, record=False)  # 256 x 128 prompt tokens at 2048 a step: all decoding by now
        for _ in range(512):
            h.submit(h.rng.integers(10, VOCAB, 4096, dtype=np.int32), 16)
        h.run(turns)
        return _summary(h, running=h.core.stats().running, waiting=h.core.stats().waiting)
    finally:
        h.close()


def scenario_b(burst: int = 64) -> dict:
    """A 1,024-token prefix is published by one request; then `burst` requests share it."""
    h = Harness(num_pages=16_384, max_rows=256)
    try:
        prefix = h.rng.integers(10, VOCAB, 1024, dtype=np.int32)
        first = h.submit(np.concatenate([prefix, h.rng.integers(10, VOCAB, 8, dtype=np.int32)]), 2)
        while h.turn(record=False):
            pass
        assert h.finished == 1, first
        for _ in range(burst):
            h.submit(np.concatenate([prefix, h.rng.integers(10, VOCAB, 32, dtype=np.int32)]), 32)
        total, turns_to_admit = 0, None
        while h.turn():
            total += h.admitted[-1]
            if total >= burst and turns_to_admit is None:
                turns_to_admit = len(h.admitted)
        s = h.core.stats()
        return _summary(h, turns_to_admit_all=turns_to_admit,
                        admitted_per_turn_first_10=h.admitted[:10],
                        cached_prompt_tokens=s.cached_prompt_tokens, prompt_tokens=s.prompt_tokens)
    finally:
        h.close()


def scenario_c(n: int = 1000) -> dict:
    """`n` short requests (64-token prompts, 32 tokens each) arrive at once."""
    h = Harness(num_pages=16_384, max_rows=256)
    try:
        for _ in range(n):
            h.submit(h.rng.integers(10, VOCAB, 64, dtype=np.int32), 32)
        total, turns_to_admit = 0, None
        while h.turn():
            total += h.admitted[-1]
            if total >= n and turns_to_admit is None:
                turns_to_admit = len(h.admitted)
        assert h.finished == n, h.finished
        return _summary(h, turns_to_admit_all=turns_to_admit)
    finally:
        h.close()


def scenario_d(turns: int) -> dict:
    """Rows are free, pages are not: admission is tried every step for a long queue."""
    h = Harness(num_pages=2_000, max_rows=300)
    try:
        for _ in range(64):
            h.submit(h.rng.integers(10, VOCAB, 128, dtype=np.int32), 4000)
        h.run(20, record=False)
        for _ in range(512):
            h.submit(h.rng.integers(10, VOCAB, 4096, dtype=np.int32), 16)
        h.run(turns)
        s = h.core.stats()
        return _summary(h, running=s.running, waiting=s.waiting)
    finally:
        h.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default="abcd")
    ap.add_argument("--turns-a", type=int, default=100, help="measured turns in scenarios a and d")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--label", default="", help="a note stored with the results")
    args = ap.parse_args()
    random.seed(0)
    out: dict = {"label": args.label}
    if "a" in args.scenarios:
        out["a"] = scenario_a(args.turns_a)
    if "b" in args.scenarios:
        out["b"] = scenario_b()
    if "c" in args.scenarios:
        out["c"] = scenario_c()
    if "d" in args.scenarios:
        out["d"] = scenario_d(args.turns_a)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
