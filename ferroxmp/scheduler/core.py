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
import math
import random
from itertools import repeat
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ferroxmp.protocol import (BatchResult, ForwardBatch, GenerateReq, GrammarReady, KVLoaded, KVTierReport, NewRow,
                               RowOut, RowStep, Stats, unpack_ids)
from ferroxmp.page_pool import PagePool
from ferroxmp.scheduler.batch import Plan, plan_batch
from ferroxmp.scheduler.cache import CacheManager, pages_for
from ferroxmp.scheduler.grammar_wait import GrammarWait
from ferroxmp.scheduler.inflight import InFlight
from ferroxmp.scheduler.outputs import Outbox
from ferroxmp.scheduler.request import Request, State, schedule_decode
from ferroxmp.scheduler.results import apply_decode, apply_steps
from ferroxmp.scheduler.settings import SchedulerConfig  # noqa: F401 (imported from here too)
from ferroxmp.scheduler.step_budget import StepBudget
from ferroxmp.scheduler.tier_index import TierIndex

MAX_LOADS = 8  # KV loads in flight at once (each waits for the worker's loader thread)

log = logging.getLogger("ferroxmp.scheduler")


@dataclass
class SchedulerCore:
    pool: PagePool
    cfg: SchedulerConfig
    cache: CacheManager = field(init=False)
    waiting: list[Request] = field(default_factory=list)
    live: dict[int, Request] = field(default_factory=dict)  # row -> request holding it
    requests: dict[str, Request] = field(default_factory=dict)  # waiting, live, or releasing
    inflight: dict[int, InFlight] = field(default_factory=dict)  # batch id -> what it holds
    outbox: Outbox = field(default_factory=Outbox)
    totals: Stats = field(default_factory=Stats)
    next_batch_id: int = 0

    def __post_init__(self) -> None:
        self.tiers = TierIndex(self.cfg.kv_host, self.cfg.kv_disk)
        self.cache = CacheManager(self.pool, self.cfg.page_size, self.cfg.radix, tiers=self.tiers)
        self._rng = random.Random(self.cfg.seed)
        self._eos = frozenset(self.cfg.eos_token_ids)
        self._expires_at = math.inf  # no waiting request can expire before this (expire's scan)
        self.step_budget = StepBudget(self.cfg.max_step_seconds, self.cfg.max_batch_tokens)
        self.grammars = GrammarWait(self.cfg.max_grammar_compile_seconds)  # constrained requests not yet queued

    # -- requests in ---------------------------------------------------------------

    def refusal(self, req: GenerateReq, n: int) -> Optional[str]:
        if req.rid in self.requests or req.rid in self.grammars.pending:
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
        p = msg.params
        stops = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self._eos)
        req = Request(msg.rid, ids, p, msg.arrival or now, seed=seed, salt=msg.cache_salt, stops=stops)
        if p.grammar is not None:  # queued once the worker has compiled its grammar (grammar_wait.py)
            self.grammars.park(req, now)
            return None
        self._queue(req)
        return None

    def _queue(self, req: Request) -> None:
        self.requests[req.rid] = req
        self.waiting.append(req)
        self._expires_at = min(self._expires_at, req.arrival + self.cfg.queue_timeout)

    def grammar_ready(self, msg: GrammarReady) -> None:
        """The worker compiled (or could not compile) a pending request's grammar."""
        req, refusal = self.grammars.answer(msg, self.totals)
        if refusal is not None:
            self.outbox.refuse(refusal)
        elif req is not None:
            self._queue(req)

    def abort(self, rid: str, reason: str = "abort") -> None:
        parked = self.grammars.drop(rid)
        if parked is not None:  # its grammar's GrammarReady will find nothing pending
            parked.finish(reason)
            self._emit(parked)
            return
        req = self.requests.get(rid)
        if req is None or req.state == State.FINISHED:
            return  # finished already, or never known: aborts are idempotent
        if req.state == State.WAITING:
            self.waiting.remove(req)
            req.finish(reason)
            self._emit(req)
            del self.requests[rid]
            self.cache.forget(req)
            return
        req.finish(reason)
        self._emit(req)
        self._release_if_done(req)

    def expire(self, now: float) -> None:
        """Refuse with 503 what waited past --queue-timeout (retracted rows already
        streamed tokens to their client: they are never dropped). The queue is scanned
        only once its oldest request can have expired (this runs every loop turn).
        A grammar pending past --max-grammar-compile-seconds is refused with a 400."""
        if self.grammars.pending:
            for out in self.grammars.expired(now):
                self.outbox.refuse(out)
        if self.cache.moves is not None and self.cache.moves.loads:
            for rid in self.cache.moves.overdue(now):
                req = self.requests.get(rid)
                if req is not None and req.kv_load is not None:
                    log.warning("KV load for %s is late; recomputing its prefix", rid)
                    req.load_over()
        if now <= self._expires_at:
            return
        for req in [r for r in self.waiting if r.retractions == 0
                    and now - r.arrival > self.cfg.queue_timeout]:
            self.waiting.remove(req)
            del self.requests[req.rid]
            self.cache.forget(req)
            self.outbox.refuse(RowOut(
                req.rid, finish_reason="error", status=503, prompt_tokens=len(req.prompt),
                error=f"the request waited {now - req.arrival:.1f}s for a free row or KV pages without being "
                      f"admitted (--queue-timeout {self.cfg.queue_timeout:g}s): retry later"))
        self._expires_at = min((r.arrival for r in self.waiting if r.retractions == 0),
                               default=math.inf) + self.cfg.queue_timeout

    # -- batches out ---------------------------------------------------------------

    def build_batch(self, now: float) -> Optional[ForwardBatch]:
        """Plan a step (a pure function) and commit the plan."""
        if self.waiting and self.cache.moves is not None and self.tiers.where:
            self._start_loads(now)
        plan = plan_batch(self.waiting, self.live.values(), self.cache, self.cfg.max_batch_tokens,
                          now, self.cfg.aging_s, self.step_budget.prefill_allowance)
        return self.commit(plan, now)

    def commit(self, plan: Plan, now: float) -> Optional[ForwardBatch]:
        """Apply a plan, in its order: retractions, the decode rows' pages, admissions (each
        takes its row, pages and adopted prefix), then every step is scheduled. Where the
        plan's page count was too hopeful (batch.py), a decode row waits a step and an
        admission is dropped, and after a blocking one, every admission after it."""
        for req in plan.retract:
            self.retract(req)
        if plan.grow and not self.cache.grow([r.cache for r in plan.grow]):
            short = [r for r in plan.grow if not self.cache.allocate(r.cache, r.scheduled + 1)]
            plan.decode = [r for r in plan.decode if r not in short]
        new_rows, chunks_planned = [], plan.steps  # + the admissions' first chunks below
        stopped = False
        for a in plan.admit:
            handle = None if stopped else self.cache.admit(a.req, plan.reserve)
            if handle is None:
                stopped = stopped or a.blocking
                continue
            req = a.req
            self.waiting.remove(req)
            first = req.admitted_at is None
            req.admit(handle, handle.adopted, now)
            self.live[req.row] = req
            if first:
                self.totals.prompt_tokens += len(req.prompt)
                self.totals.cached_prompt_tokens += req.cached_tokens
            new_rows.append(self.new_row(req))
            remaining = req.known_len - handle.adopted  # eviction may have taken part of its match
            chunk = min(remaining, a.chunk)
            chunks_planned.append((req, chunk, chunk == remaining))
        if not plan.decode and not chunks_planned:
            return None
        # Decode rows in one pass (most of a step); then the prefill chunks.
        rows, starts = schedule_decode(plan.decode)
        steps = list(map(RowStep, rows, starts, repeat(1), repeat(True)))  # no Python loop per row
        if rows:
            self.cache.set_lengths(rows, np.add(starts, 1))
        chunks = []
        for req, length, sample in chunks_planned:
            step = RowStep(req.row, req.scheduled, length, sample)
            req.schedule(length, sample)
            chunks.append((req, step))
            steps.append(step)
        if chunks:
            self.cache.set_lengths([s.row for _, s in chunks], [s.start + s.length for _, s in chunks])
        spec = self._draft_budget(plan.decode, starts, bool(chunks)) if self.cfg.spec_tokens and rows else {}
        batch = ForwardBatch(self.next_batch_id, new_rows, steps, spec)
        self.inflight[batch.batch_id] = InFlight(plan.decode, rows, starts, chunks, bool(spec))
        self.next_batch_id += 1
        self.totals.steps += 1
        if self.cfg.sliding_window and self.totals.steps % self.cfg.swa_release_interval == 0:
            for req in self.live.values():
                self.cache.release_window(req, self.cfg.sliding_window)
        return batch

    @property
    def lookahead_inflight(self) -> bool:
        """A batch in flight lets some row take more than one token (a draft budget or
        --decode-steps): how far it moves is known only from the result, so no batch may be
        planned behind it (its rows' starts would be wrong)."""
        return any(b.lookahead for b in self.inflight.values())

    def _draft_budget(self, decode: list[Request], starts: list[int], chunks: bool) -> dict[int, int]:
        """Speculation (--speculative-ngram or --draft-model: one rule for both) and
        --decode-steps: how many draft tokens each decode row may have verified this step, or
        further steps it may take in the same call (row -> k), with pages
        held for them. Only rows whose draw depends on nothing but the logits, seed and
        position (no grammar, bias, min_tokens, penalties; no logprobs); never past
        max_tokens; and drafting takes only free pages: it never evicts a cached prefix
        or retracts a row. Where the worker caps a step's verified tokens (CPU: a step of
        more tokens is compute-bound, each draft costing what a decoded token does), the
        rows share what the cap leaves above one token each: of a cap of 16, 1 row drafts up
        to 15, 4 rows 3 each, 8 rows 1, 9 or more none. Further steps (--decode-steps) run
        only in a batch of decode rows that all choose by argmax, as many as its least row
        may take (the worker's rule, runner._plan_steps), and not while a request waits
        (its first chunk would wait those steps): any other batch gets no budget, and so
        keeps the overlap."""
        out, ps, cap = {}, self.cfg.page_size, self.cfg.spec_step_tokens
        share = self.cfg.spec_tokens if cap is None else min(self.cfg.spec_tokens, (cap - len(decode)) // len(decode))
        if self.cfg.decode_steps:
            if chunks or self.waiting or not all(r.params.greedy and r.params.may_draft for r in decode):
                return out
            share = min(share, min(r.params.max_tokens - r.n_output - 1 for r in decode))
        if share <= 0:
            return out
        for req, start in zip(decode, starts):
            p = req.params
            if not p.may_draft:
                continue
            k = min(share, p.max_tokens - req.n_output - 1)
            have = len(req.cache.pages) * ps
            if k > 0 and start + 1 + k > have and not (
                    pages_for(start + 1 + k, ps) - len(req.cache.pages) <= self.pool.free_count
                    and self.cache.allocate(req.cache, start + 1 + k)):
                k = have - start - 1
            if k > 0:
                out[req.cache.row] = k
        return out

    def _start_loads(self, now: float) -> None:
        """Waiting requests whose prompt continues below the pool start loading it; they
        are admitted once it is in the pool (kv_loaded) or overdue (expire)."""
        moves = self.cache.moves
        reserve = sum(1 for r in self.live.values() if r.state is State.DECODING and not r.retracting)
        for req in self.waiting:
            if len(moves.loads) >= MAX_LOADS:
                break
            moves.start_load(req, reserve, now, self.step_budget.tokens_per_s)

    def kv_loaded(self, msg: KVLoaded) -> None:
        done = self.cache.moves.finish(msg) if self.cache.moves is not None else None
        if done is None:
            return
        rid, host, disk = done
        req = self.requests.get(rid)
        if req is not None and req.kv_load == msg.load_id:  # it waited for them: its hits
            req.load_over()
            self.totals.kv_hit_tokens_host += host
            self.totals.kv_hit_tokens_disk += disk

    def kv_report(self, msg: KVTierReport) -> None:
        self.tiers.apply(msg)

    def flush_cache(self, rid: str) -> None:
        """POST /cache/flush: every cached prefix no row holds leaves the pool, and the
        host and disk tiers are emptied (the worker, in order after earlier saves)."""
        if self.cache.moves is not None:
            self.cache.moves.flush()
        elif self.cache.tree is not None:
            self.cache.evict(self.cache.tree.num_pages)
        log.info("cache flushed: %d pages still held by rows", self.cache.pages_in_use)
        self.outbox.refuse(RowOut(rid, finish_reason="stop"))

    def take_kv_ops(self) -> list:
        """Saves, loads and flushes for the worker: send them before any later batch."""
        return self.cache.moves.take_ops() if self.cache.moves is not None and self.cache.moves.ops else []

    def new_row(self, req: Request) -> NewRow:
        return NewRow(req.row, req.ids.packed(), req.params, req.seed,
                      len(req.prompt))

    def retract(self, req: Request) -> None:
        """Free a decoding row's pages for older rows; it re-queues ahead of new work
        and, because it publishes first, re-admission is mostly a cache hit."""
        req.start_retract()
        self.totals.retractions += 1
        log.info("retracting %s at %d tokens (pool exhausted)", req.rid, req.known_len)
        self._release_if_done(req)

    # -- results in ----------------------------------------------------------------

    def process_result(self, res: BatchResult, now: float) -> None:
        """Apply a batch's result. A row the worker could not compute (`row_errors`, or
        the whole batch's `error`) ends its request with an error; the batch's other
        rows go on. Every row's `inflight` drops either way, so pages come back once,
        after the last batch that referenced them reported."""
        batch = self.inflight.pop(res.batch_id, None)
        if batch is None:
            log.error("result for unknown batch %d dropped", res.batch_id)
            return
        self.totals.worker_busy_seconds += res.compute_s
        self.totals.spec_draft_tokens += res.spec_drafted
        self.totals.spec_accepted_tokens += res.spec_accepted
        if res.error is None:  # the step's size and time teach the budget this machine's speed
            self.step_budget.observe(batch.tokens, res.compute_s)
        if res.error:
            log.error("worker refused batch %d: %s", res.batch_id, res.error)
        failed = res.error is not None or bool(res.row_errors)
        tokens = None if failed or res.prompt_logprobs else batch.decode_tokens(res)
        news = self.outbox.news
        if tokens is None:  # row by row: errors, or rows out of step order
            n, ended = apply_steps(res, list(batch), self.cache, news)
        else:
            n, ended = apply_decode(batch, tokens, res.logprobs, news, res.spec_tokens)
            if batch.chunks:
                n2, ended2 = apply_steps(res, batch.chunks, self.cache, news)
                n, ended = n + n2, ended + ended2
        self.totals.generation_tokens += n
        for req in ended:
            self._release_if_done(req)

    def _release_if_done(self, req: Request) -> None:
        if req.inflight > 0 or req.cache is None:
            return
        if req.state == State.FINISHED:
            del self.live[req.row]
            self.cache.release(req)
            self.requests.pop(req.rid, None)
            self.cache.forget(req)
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
        return (not self.waiting and not self.live and not self.inflight and not self.grammars.pending
                and not (self.cache.moves is not None and self.cache.moves.loads))

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
        s.step_token_budget = self.step_budget.step_tokens
        s.grammar_pending = len(self.grammars.pending)
        s.kv_hit_tokens_pool = max(0, s.cached_prompt_tokens - s.kv_hit_tokens_host - s.kv_hit_tokens_disk)
        s.kv_tiers = self.tiers.worker
        return s

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        assert {r: q.cache for r, q in self.live.items()} == self.cache.handles, "live rows != handles"
        counts: dict[str, int] = {}
        for steps in self.inflight.values():
            for req, _ in steps:
                counts[req.rid] = counts.get(req.rid, 0) + 1
        for req in self.cache.memos:  # a dropped request's memo would leak, never mislead (by identity)
            assert self.requests.get(req.rid) is req, f"the cache manager remembers {req.rid}, which is gone"
        for req in self.requests.values():
            assert req.inflight == counts.get(req.rid, 0), (req.rid, req.inflight)
            assert (req.state == State.WAITING) == (req in self.waiting), (req.rid, req.state)
        if self.idle:
            tree_pages = self.cache.tree.num_pages if self.cache.tree is not None else 0
            assert self.pool.free_count + tree_pages == self.pool.num_pages, \
                "idle, yet pages are held by something other than the tree"
