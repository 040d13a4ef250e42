"""Planning one step: every decoding row, then prefill chunks, then admissions, up to
the token budget. `plan_batch` is a pure function of (queues, a read of the cache
manager, budget): it counts pages instead of taking them, changes no request, no page
and no tree node, and returns a `Plan` as data; `SchedulerCore.commit` applies it.

Order is the policy: decode rows first (one token each, oldest first), so a long
prompt being prefilled never stalls anyone's stream; then chunks of rows already
prefilling; then admissions, each with its first chunk, in `admission_order`.

A candidate is deferred only while the part of its prefix that the tree LACKS is
being computed by a row that is prefilling now: its next page after what it could
adopt is that row's next page to publish. Everything that can adopt what is cached
is admitted in the same step, as many as fit. A blocking candidate (retracted or
aged) that is deferred or does not fit stops admission: nothing younger passes it.

Pages are counted against `CacheManager.available_pages` (free, plus what eviction
could free): the decode rows at a page boundary take one each; when they cannot all
have one, the youngest row is retracted (its pages come back when the core releases
it, at once or when its batch in flight reports) and the row without a page waits a
step. One retraction at a time: a pending one may already cover the need. Each
admission takes the pages its match leaves to compute. The count is an upper bound
(an adopted prefix, once locked, is no longer evictable), so `commit` can still find
an allocation short: then the decode row waits a step, or the admission is dropped
(and, if it was blocking, every admission after it), exactly as if the page had not
been there when planning.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, Iterable, Optional

from ferroxmp.scheduler.cache import CacheManager
from ferroxmp.scheduler.policy import admission_order
from ferroxmp.scheduler.request import Request, State


@dataclass(slots=True)
class Admission:
    req: Request
    chunk: int  # prefill tokens planned for it this step (from what it is expected to adopt)
    blocking: bool  # if it cannot be admitted after all, no admission after it is either


@dataclass
class Plan:
    # Decode rows, one sampled token each, oldest first: the bulk of a step, kept apart
    # from the chunks so the core applies them in one tight pass (no tuple per row).
    decode: list[Request] = field(default_factory=list)
    grow: list[Request] = field(default_factory=list)  # decode rows at a page boundary: one page each
    steps: list[tuple[Request, int, bool]] = field(default_factory=list)  # prefilling rows' chunks
    admit: list[Admission] = field(default_factory=list)  # their first chunks go after `steps`
    retract: list[Request] = field(default_factory=list)
    reserve: int = 0  # pages admissions leave for the decode rows


_ARRIVAL = attrgetter("arrival")


def plan_batch(waiting: list[Request], live: Iterable[Request], cache: CacheManager,
               budget: int, now: float, aging_s: float,
               prefill_cap: Optional[Callable[[int], int]] = None) -> Plan:
    """`budget` bounds the step's tokens; `prefill_cap(n_decode)`, when given, also
    bounds the prefill tokens that ride with n_decode decode rows (the time bound:
    step_budget.py). Decode rows are never cut by it."""
    plan = Plan()
    live = sorted(live, key=_ARRIVAL)
    prefilling, left, pages = _plan_decode(plan, live, cache, budget)
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
        plan.reserve = reserve
        if pages is None:
            pages = cache.available_pages - len(plan.grow)
        if pages > reserve:
            # Until its last chunk reports back (computed, not merely scheduled), a
            # prefix is not in the tree yet.
            active = (State.PREFILLING, State.DECODING)
            unpublished = [r for r in live if not r.retracting and r.state in active
                           and r.computed < r.prefill_target]
            _admit(plan, waiting, unpublished, cache, budget, pages, now, aging_s)
    return plan


def _plan_decode(plan: Plan, live: list[Request], cache: CacheManager,
                 budget: int) -> tuple[list[Request], int, Optional[int]]:
    """One pass over every live row (this runs every step): decode rows are planned
    oldest first, prefilling rows collected for after them. Returns those, the token
    budget and the pages left. If the rows at a page boundary cannot all have a page,
    the pass is made again giving pages oldest first and retracting for the first row
    left without one. The pages left are None when not counted (the pool's count is
    read only when a row grows: most steps none does)."""
    decode, prefilling, grow = plan.decode, [], plan.grow
    decoding_state, prefilling_state = State.DECODING, State.PREFILLING
    start_budget, ps = budget, cache.page_size
    for req in live:
        if req.retracting:
            continue
        state = req.state
        if state is prefilling_state:
            prefilling.append(req)
        elif (state is decoding_state and budget > 0
              and req.sampled_scheduled + req.sampled_before < req.params.max_tokens):  # sampling steps left
            if req.scheduled >= len(req.cache.pages) * ps:  # at a page boundary
                grow.append(req)
            decode.append(req)
            budget -= 1
    if not grow:
        return prefilling, budget, None
    pages = cache.available_pages
    if len(grow) <= pages:
        return prefilling, budget, pages - len(grow)
    # The pool is short: row by row, oldest first; a row without a page waits a step.
    decode.clear()
    grow.clear()
    budget, retract = start_budget, plan.retract
    for req in live:
        if req.retracting or req.state is not decoding_state or (retract and req in retract):
            continue
        if budget > 0 and req.sampled_scheduled + req.sampled_before < req.params.max_tokens:
            if req.scheduled >= len(req.cache.pages) * ps:
                if pages <= 0:
                    _retract_for(req, live, plan)
                    continue  # no page this step; it comes back when the retracted row is released
                grow.append(req)
                pages -= 1
            decode.append(req)
            budget -= 1
    if retract:
        prefilling = [r for r in prefilling if r not in retract]
    return prefilling, budget, pages


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
           budget: int, pages: int, now: float, aging_s: float) -> None:
    ps = cache.page_size
    share = cache.tree is not None
    pending = _next_pages(prefilling, ps) if share else {}
    rows = len(cache.free_rows)
    for req, blocking in admission_order(waiting, now, aging_s, cache.match):
        if budget <= 0 or rows <= 0:
            break
        if req.kv_load is not None:
            continue  # its prefix is on its way up from the host/disk tier (tier_moves.py)
        adopt = cache.match(req)  # what admission adopts: the same capped, page-aligned match
        if pending:
            end = adopt + ps
            if end < req.known_len and (req.salt, req.tokens[:end].tobytes()) in pending:
                if blocking:
                    break  # an aged request waits for the prefix; nothing younger passes it
                continue
        need = cache.pages_needed(req)
        if pages - need < plan.reserve:
            if blocking:
                break
            continue
        remaining = req.known_len - adopt
        chunk = min(remaining, budget)
        plan.admit.append(Admission(req, chunk, blocking))
        pages -= need
        rows -= 1
        budget -= chunk
        end = (adopt // ps + 1) * ps
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
