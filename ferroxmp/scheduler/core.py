"""SchedulerCore: requests in, batches out, results in, token outputs out. No sockets.

The event loop (scheduler.py) and in-process tests drive the same object, so the
tests exercise the real admission → chunked prefill → handover → finish path.
The core owns the queues and the requests' states; the cache manager (cache.py)
owns pages, the page table, the tree and row slots; `plan_batch` (batch.py) plans
a step from both and the core applies the plan.

Invariants (checked by `check_integrity`): every live row is in `live`; every
request in flight is counted in its `inflight`; pages and row slots of a finished
or retracted request return only when its `inflight` reaches 0 — whatever the
worker answered, so the two processes never disagree about what a row holds.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ferroxmp.protocol import (BatchResult, ForwardBatch, GenerateReq, NewRow, RowOut,
                               RowStep, Stats, unpack_ids)
from ferroxmp.radix.pages import PagePool
from ferroxmp.scheduler.batch import plan_batch
from ferroxmp.scheduler.cache import CacheManager
from ferroxmp.scheduler.outputs import Outbox
from ferroxmp.scheduler.request import Request, State
from ferroxmp.scheduler.settings import SchedulerConfig  # noqa: F401 (imported from here too)

log = logging.getLogger("ferroxmp.scheduler")


@dataclass
class SchedulerCore:
    pool: PagePool
    cfg: SchedulerConfig
    cache: CacheManager = field(init=False)
    waiting: list[Request] = field(default_factory=list)
    live: dict[int, Request] = field(default_factory=dict)  # row -> request holding it
    requests: dict[str, Request] = field(default_factory=dict)  # waiting, live, or releasing
    inflight: dict[int, list[tuple[Request, RowStep]]] = field(default_factory=dict)
    outbox: Outbox = field(default_factory=Outbox)
    totals: Stats = field(default_factory=Stats)
    next_batch_id: int = 0

    def __post_init__(self) -> None:
        self.cache = CacheManager(self.pool, self.cfg.page_size, self.cfg.radix)
        self._rng = random.Random(self.cfg.seed)

    # -- requests in ---------------------------------------------------------------

    def refusal(self, req: GenerateReq, n: int) -> Optional[str]:
        if req.rid in self.requests:
            return f"request id {req.rid!r} is already running"
        return self.cfg.refusal(req.params, n, self.pool.num_pages)

    def add_request(self, msg: GenerateReq, now: float) -> Optional[RowOut]:
        """Queue a request, or return its refusal (400: it can never fit)."""
        ids = unpack_ids(msg.input_ids)
        why = self.refusal(msg, len(ids))
        if why is None and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            why = f"token ids must be in [0, {self.cfg.vocab_size}); got {ids.min()}..{ids.max()}"
        if why is not None:
            out = RowOut(msg.rid, finish_reason="error", status=400, error=why, prompt_tokens=len(ids))
            log.info("refused %s: %s", msg.rid, out.error)
            return out
        seed = msg.params.seed if msg.params.seed is not None else self._rng.getrandbits(31)
        req = Request(msg.rid, ids, msg.params, msg.arrival or now, seed=seed, salt=msg.cache_salt)
        self.requests[req.rid] = req
        self.waiting.append(req)
        return None

    def abort(self, rid: str, reason: str = "abort") -> None:
        req = self.requests.get(rid)
        if req is None or req.state == State.FINISHED:
            return  # finished already, or never known: aborts are idempotent
        if req.state == State.WAITING:
            self.waiting.remove(req)
            req.finish(reason)
            self._emit(req)
            del self.requests[rid]
            return
        req.finish(reason)
        self._emit(req)
        self._release_if_done(req)

    def expire(self, now: float) -> None:
        """Refuse with 503 what waited past --queue-timeout (retracted rows already
        streamed tokens to their client: they are never dropped)."""
        for req in [r for r in self.waiting if r.retractions == 0
                    and now - r.arrival > self.cfg.queue_timeout]:
            self.waiting.remove(req)
            del self.requests[req.rid]
            self.outbox.refuse(RowOut(
                req.rid, finish_reason="error", status=503, prompt_tokens=len(req.prompt),
                error=f"the request waited {now - req.arrival:.1f}s for a free row or KV pages without being "
                      f"admitted (--queue-timeout {self.cfg.queue_timeout:g}s): retry later"))

    # -- batches out ---------------------------------------------------------------

    def build_batch(self, now: float) -> Optional[ForwardBatch]:
        """Plan a step and apply the plan: retractions, admissions, then the steps."""
        plan = plan_batch(self.waiting, self.live.values(), self.cache, self.cfg.max_batch_tokens,
                          now, self.cfg.aging_s)
        for req in plan.retract:
            self.retract(req)
        new_rows = []
        for req, handle in plan.admitted:
            self.waiting.remove(req)
            first = req.admitted_at is None
            req.admit(handle, handle.adopted, now)
            self.live[req.row] = req
            if first:
                self.totals.prompt_tokens += len(req.prompt)
                self.totals.cached_prompt_tokens += req.cached_tokens
            new_rows.append(self.new_row(req))
        if not plan.steps:
            return None
        steps, rows, ends = [], [], []
        for req, length, sample in plan.steps:
            step = RowStep(req.row, req.scheduled, length, sample)
            req.schedule(length, sample)
            steps.append((req, step))
            rows.append(step.row)
            ends.append(req.scheduled)
        self.cache.set_lengths(rows, ends)
        batch = ForwardBatch(self.next_batch_id, new_rows, [s for _, s in steps])
        self.inflight[batch.batch_id] = steps
        self.next_batch_id += 1
        self.totals.steps += 1
        if self.cfg.sliding_window and self.totals.steps % self.cfg.swa_release_interval == 0:
            for req in self.live.values():
                self.cache.release_window(req, self.cfg.sliding_window)
        return batch

    def new_row(self, req: Request) -> NewRow:
        return NewRow(req.row, np.asarray(req.tokens, "<i4").tobytes(), req.params, req.seed,
                      len(req.prompt))

    def retract(self, req: Request) -> None:
        """Free a decoding row's pages for older rows; it re-queues ahead of new work
        and, because it publishes first, re-admission is mostly a cache hit."""
        req.retracting = True
        self.totals.retractions += 1
        log.info("retracting %s at %d tokens (pool exhausted)", req.rid, req.known_len)
        self._release_if_done(req)

    # -- results in ----------------------------------------------------------------

    def process_result(self, res: BatchResult, now: float) -> None:
        """Apply a batch's result. A row the worker could not compute (`row_errors`, or
        the whole batch's `error`) ends its request with an error; the batch's other
        rows go on. Every row's `inflight` drops either way, so pages come back once,
        after the last batch that referenced them reported."""
        steps = self.inflight.pop(res.batch_id, None)
        if steps is None:
            log.error("result for unknown batch %d dropped", res.batch_id)
            return
        self.totals.worker_busy_seconds += res.compute_s
        if res.error:
            log.error("worker refused batch %d: %s", res.batch_id, res.error)
        row_errors, logprobs = res.row_errors, res.logprobs
        failed = res.error is not None or bool(row_errors)
        sampled = dict(zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist()))
        for req, step in steps:
            req.inflight -= 1
            if failed and (why := res.error or row_errors.get(step.row)) is not None:
                if req.state != State.FINISHED:
                    log.error("request %s failed in batch %d: %s", req.rid, res.batch_id, why)
                    req.finish("error", f"the model worker failed this request: {why}")
                    self._emit(req)
                continue
            if req.finish_reason == "error":
                continue  # its KV is not trusted any more: never published, never extended
            if res.prompt_logprobs and (plps := res.prompt_logprobs.get(step.row)):
                self._add_prompt_logprobs(req, step.start + 1, plps)
            end = step.start + step.length
            if end > req.computed:
                req.computed = end
            if step.start < req.prefill_target and req.state != State.FINISHED and not req.retracting:
                self.cache.publish(req)  # a finished prefill chunk is shared at once (contract 1)
            if step.sample and req.state != State.FINISHED:
                token = sampled.get(step.row)
                if token is None:
                    req.finish("error", f"the model worker returned no token for row {step.row}")
                    self._emit(req)
                    continue
                self._append(req, token, logprobs.get(step.row) if logprobs else None)
        for req, _ in steps:
            if req.inflight == 0 and (req.state is State.FINISHED or req.retracting):
                self._release_if_done(req)

    @staticmethod
    def _add_prompt_logprobs(req: Request, first: int, lps: list) -> None:
        """Keep, in order, the entries for prompt positions not reported yet; they travel
        with the request's next RowOut (the one carrying its first token)."""
        skip = req.prompt_logprobs_next - first
        if 0 <= skip < len(lps):
            req.pending_prompt_logprobs.extend(lps[skip:])
            req.prompt_logprobs_next = first + len(lps)

    def _append(self, req: Request, token: int, logprobs) -> None:
        req.output.append(token)
        self.totals.generation_tokens += 1
        if logprobs is not None:
            req.pending_logprobs.append(logprobs)
        p = req.params
        if (not p.ignore_eos and token in self.cfg.eos_token_ids) or token in p.stop_token_ids:
            req.finish("stop")
        elif len(req.output) >= p.max_tokens:
            req.finish("length")
        self._emit(req)

    def _release_if_done(self, req: Request) -> None:
        if req.inflight > 0 or req.cache is None:
            return
        if req.state == State.FINISHED:
            del self.live[req.row]
            self.cache.release(req)
            self.requests.pop(req.rid, None)
        elif req.retracting:
            del self.live[req.row]
            self.cache.release(req)
            req.retract()
            self.waiting.append(req)

    def _emit(self, req: Request) -> None:
        self.outbox.note(req)

    def take_outputs(self) -> list[RowOut]:
        return self.outbox.take()

    # -- state ---------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.live and not self.inflight

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(
            r.state in (State.PREFILLING, State.DECODING) and not r.retracting and not r.done_sampling
            for r in self.live.values())

    def stats(self) -> Stats:
        """Counters kept as they change: no walk over the tree or the pool."""
        s = Stats(**{f: getattr(self.totals, f) for f in self.totals.__struct_fields__})
        # Rows holding a slot, finished ones included until their last batch reports: a
        # heartbeat saying 0 running means no row holds a page.
        s.running = len(self.live)
        s.waiting = len(self.waiting)
        s.pages_total = self.pool.num_pages
        s.pages_free = self.pool.free_count
        s.pages_in_use = self.cache.pages_in_use
        s.pages_cached = self.cache.pages_cached
        return s

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        assert {r: q.cache for r, q in self.live.items()} == self.cache.handles, "live rows != handles"
        counts: dict[str, int] = {}
        for steps in self.inflight.values():
            for req, _ in steps:
                counts[req.rid] = counts.get(req.rid, 0) + 1
        for req in self.requests.values():
            assert req.inflight == counts.get(req.rid, 0), (req.rid, req.inflight)
            assert (req.state == State.WAITING) == (req in self.waiting), (req.rid, req.state)
        if self.idle:
            tree_pages = self.cache.tree.num_pages if self.cache.tree is not None else 0
            assert self.pool.free_count + tree_pages == self.pool.num_pages, \
                "idle, yet pages are held by something other than the tree"
