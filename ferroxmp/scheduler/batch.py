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

When a decode row needs a page the pool cannot give even after eviction, the
youngest row is retracted; its pages come back when the core releases it (at once,
or when its batch in flight reports), so the row waits a step. One retraction at a
time: a pending one may already cover the need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ferroxmp.scheduler.cache import CacheHandle, CacheManager
from ferroxmp.scheduler.policy import admission_order
from ferroxmp.scheduler.request import Request, State


@dataclass
class Plan:
    steps: list[tuple[Request, int, bool]] = field(default_factory=list)  # (request, length, sample)
    admitted: list[tuple[Request, CacheHandle]] = field(default_factory=list)
    retract: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.steps and not self.retract


def plan_batch(waiting: list[Request], live: Iterable[Request], cache: CacheManager,
               budget: int, now: float, aging_s: float) -> Plan:
    plan = Plan()
    live = sorted(live, key=lambda r: r.arrival)
    active = [r for r in live if not r.retracting and r.state != State.FINISHED]
    decoding = [r for r in active if r.state == State.DECODING and not r.done_sampling]
    pending_retraction = any(r.retracting for r in live)

    for req in decoding:
        if budget <= 0:
            break
        if req in plan.retract:
            continue
        if not cache.allocate(req.cache, req.scheduled + 1):
            if not pending_retraction:
                younger = [r for r in active[active.index(req) + 1:] if r not in plan.retract]
                if younger:
                    plan.retract.append(younger[-1])
                    pending_retraction = True
            continue  # no page this step; it comes back when the retracted row is released
        plan.steps.append((req, 1, True))
        budget -= 1

    prefilling = [r for r in active if r.state == State.PREFILLING and r not in plan.retract]
    for req in sorted(prefilling, key=lambda r: r.admitted_at or 0.0):
        if budget <= 0:
            break
        chunk = min(req.prefill_target - req.scheduled, budget)
        plan.steps.append((req, chunk, req.scheduled + chunk == req.prefill_target))
        budget -= chunk

    if budget > 0 and waiting and cache.free_rows and not plan.retract:
        # Until its last chunk reports back (computed, not merely scheduled), a prefix
        # is not in the tree yet.
        unpublished = [r for r in active if r.computed < r.prefill_target]
        _admit(plan, waiting, unpublished, cache, budget, now, aging_s, reserve=len(decoding))
    return plan


def _admit(plan: Plan, waiting: list[Request], prefilling: list[Request], cache: CacheManager,
           budget: int, now: float, aging_s: float, reserve: int) -> None:
    ps = cache.page_size
    share = cache.tree is not None
    pending = _next_pages(prefilling, ps) if share else {}
    for req, blocking in admission_order(waiting, now, aging_s, cache.match):
        if budget <= 0 or not cache.free_rows:
            break
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
