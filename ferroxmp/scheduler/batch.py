"""Planning one step: every decoding row, then prefill chunks, then admissions, up to
the token budget. `plan_batch` reads the queues and asks the cache manager for pages;
it returns a `Plan` and changes no request: the core applies it.

Order is the policy: decode rows first (one token each, oldest first), so a long
prompt being prefilled never stalls anyone's stream; then chunks of rows already
prefilling; then admissions, each with its first chunk, in `admission_order`.

A candidate is deferred only while the part of its prefix that the tree LACKS is
being computed by a row that is prefilling now: its next page after what it could
adopt is that row's next page to publish. Everything that can adopt what is cached
is admitted in the same step, as many as fit. A blocking candidate (retracted or
aged) that is deferred or does not fit stops admission: nothing younger passes it.

Decode rows are planned in one pass over the live rows; those at a page boundary
get their next page in one allocation (`CacheManager.grow`). Only when the pool
cannot give them all is the step planned again row by row.

When a decode row needs a page the pool cannot give even after eviction, the
youngest row is retracted; its pages come back when the core releases it (at once,
or when its batch in flight reports), so the row waits a step. One retraction at a
time: a pending one may already cover the need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, Iterable, Optional

from ferroxmp.scheduler.cache import CacheHandle, CacheManager
from ferroxmp.scheduler.policy import admission_order
from ferroxmp.scheduler.request import Request, State


@dataclass
class Plan:
    # Decode rows, one sampled token each, oldest first: the bulk of a step, kept apart
    # from the chunks so the core applies them in one tight pass (no tuple per row).
    decode: list[Request] = field(default_factory=list)
    steps: list[tuple[Request, int, bool]] = field(default_factory=list)  # chunks: (request, length, sample)
    admitted: list[tuple[Request, CacheHandle]] = field(default_factory=list)
    retract: list[Request] = field(default_factory=list)


_ARRIVAL = attrgetter("arrival")


def plan_batch(waiting: list[Request], live: Iterable[Request], cache: CacheManager,
               budget: int, now: float, aging_s: float,
               prefill_cap: Optional[Callable[[int], int]] = None) -> Plan:
    """`budget` bounds the step's tokens; `prefill_cap(n_decode)`, when given, also
    bounds the prefill tokens that ride with n_decode decode rows (the time bound:
    step_budget.py). Decode rows are never cut by it."""
    plan = Plan()
    live = sorted(live, key=_ARRIVAL)
    prefilling, left = _plan_decode(plan, live, cache, budget, bulk=True)
    if left is None:  # the pool is short of pages: again row by row, retracting if need be
        plan.decode.clear()
        prefilling, left = _plan_decode(plan, live, cache, budget, bulk=False)
    budget = left if prefill_cap is None else min(left, prefill_cap(len(plan.decode)))

    retract = plan.retract
    if len(prefilling) > 1:
        prefilling.sort(key=lambda r: r.admitted_at or 0.0)
    for req in prefilling:
        if budget <= 0:
            break
        if retract and req in retract:
            continue
        chunk = min(req.prefill_target - req.scheduled, budget)
        plan.steps.append((req, chunk, req.scheduled + chunk == req.prefill_target))
        budget -= chunk

    if budget > 0 and waiting and cache.free_rows and not retract:
        reserve = sum(1 for r in live if not r.retracting and r.state is State.DECODING
                      and r.sampled_scheduled + r.sampled_before < r.params.max_tokens)
        # Every admission needs at least one fresh page beyond the decode rows' reserve:
        # without one, the queue is not even scored.
        if cache.available_pages > reserve:
            # Until its last chunk reports back (computed, not merely scheduled), a
            # prefix is not in the tree yet.
            active = (State.PREFILLING, State.DECODING)
            unpublished = [r for r in live if not r.retracting and r.state in active
                           and r.computed < r.prefill_target]
            _admit(plan, waiting, unpublished, cache, budget, now, aging_s, reserve=reserve)
    return plan


def _plan_decode(plan: Plan, live: list[Request], cache: CacheManager, budget: int,
                 bulk: bool) -> tuple[list[Request], Optional[int]]:
    """One pass over every live row (this runs every step): decode rows are planned
    oldest first, prefilling rows collected for after them. Returns those and the
    budget left. With `bulk`, rows at a page boundary get their pages in one
    allocation at the end; if the pool cannot give them all, no page was taken
    (eviction may have run) and the budget is None: the caller plans again
    without `bulk`, row by row, retracting as the policy says."""
    decode, prefilling, retract, grow = plan.decode, [], plan.retract, []
    decoding_state, prefilling_state = State.DECODING, State.PREFILLING
    ps = cache.page_size
    for req in live:
        if req.retracting or (retract and req in retract):
            continue
        state = req.state
        if state is prefilling_state:
            prefilling.append(req)
        elif (state is decoding_state and budget > 0
              and req.sampled_scheduled + req.sampled_before < req.params.max_tokens):  # sampling steps left
            if req.scheduled >= len(req.cache.pages) * ps:  # at a page boundary
                if bulk:
                    grow.append(req.cache)
                elif not cache.allocate(req.cache, req.scheduled + 1):
                    _retract_for(req, live, plan)
                    continue  # no page this step; it comes back when the retracted row is released
            decode.append(req)
            budget -= 1
    if grow and not cache.grow(grow):
        return prefilling, None
    return prefilling, budget


def _retract_for(req: Request, live: list[Request], plan: Plan) -> None:
    """A decode row got no page: retract the youngest active row younger than it,
    unless a retraction is already pending (it may cover the need)."""
    if any(r.retracting for r in live) or plan.retract:
        return
    younger = [r for r in live[live.index(req) + 1:]
               if not r.retracting and r.state in (State.PREFILLING, State.DECODING)]
    if younger:
        plan.retract.append(younger[-1])


def _admit(plan: Plan, waiting: list[Request], prefilling: list[Request], cache: CacheManager,
           budget: int, now: float, aging_s: float, reserve: int) -> None:
    ps = cache.page_size
    share = cache.tree is not None
    pending = _next_pages(prefilling, ps) if share else {}
    for req, blocking in admission_order(waiting, now, aging_s, cache.match):
        if budget <= 0 or not cache.free_rows:
            break
        if req.kv_load is not None:
            continue  # its prefix is on its way up from the host/disk tier (tier_moves.py)
        if pending:
            end = cache.match(req) + ps
            if end < req.known_len and (req.salt, req.tokens[:end].tobytes()) in pending:
                if blocking:
                    break  # an aged request waits for the prefix; nothing younger passes it
                continue
        handle = cache.admit(req, reserve)
        if handle is None:
            if blocking:
                break
            continue
        plan.admitted.append((req, handle))
        remaining = req.known_len - handle.adopted
        chunk = min(remaining, budget)
        plan.steps.append((req, chunk, chunk == remaining))
        budget -= chunk
        end = (handle.adopted // ps + 1) * ps
        if share and end <= req.known_len:
            pending[(req.salt, req.tokens[:end].tobytes())] = req


def _next_pages(prefilling: list[Request], page_size: int) -> dict[tuple[str, bytes], Request]:
    """For each row prefilling a prompt, (salt, its tokens up to the end of the next page
    it will publish). A candidate whose own next page is that key would compute it
    twice: it waits one chunk and adopts it."""
    out: dict[tuple[str, bytes], Request] = {}
    for r in prefilling:
        end = (r.computed // page_size + 1) * page_size
        if end <= r.prefill_target:
            out[(r.salt, r.tokens[:end].tobytes())] = r
    return out
