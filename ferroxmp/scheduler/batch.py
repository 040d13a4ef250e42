"""Planning one step: every decoding row, then prefill chunks, up to the token budget.

Order matters and is the policy: decode rows first (one token each, oldest
first), so a long prompt being prefilled never stalls anyone's stream; then
chunks of rows already prefilling; then new admissions, each with its first
chunk — except a request whose prefix another row is prefilling right now: it
waits for that prefix to be published and adopts it instead of computing it twice. When a decode row needs a page the pool cannot give even after
eviction, the youngest decoding rows are retracted until it can.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ferroxmp.protocol import NewRow, RowStep
from ferroxmp.scheduler.policy import admission_order
from ferroxmp.scheduler.request import Request, State

if TYPE_CHECKING:
    from ferroxmp.scheduler.core import SchedulerCore


@dataclass
class Plan:
    new_rows: list[NewRow] = field(default_factory=list)
    steps: list[tuple[Request, RowStep]] = field(default_factory=list)

    def add(self, req: Request, length: int, sample: bool, pool) -> None:
        self.steps.append((req, RowStep(req.row, req.scheduled, length, sample)))
        req.schedule(length, sample)
        pool.row_lens[req.row] = req.scheduled


def plan_batch(core: "SchedulerCore", now: float) -> Plan:
    plan, rows, pool = Plan(), core.rows, core.pool
    budget = core.cfg.max_batch_tokens
    live = sorted(rows.live.values(), key=lambda r: r.arrival)
    active = [r for r in live if not r.retracting and r.state != State.FINISHED]

    decoding = [r for r in active if r.state == State.DECODING and not r.done_sampling]
    for req in decoding:
        if budget <= 0:
            break
        if req.retracting or req.state != State.DECODING:
            continue  # retracted earlier in this loop (and maybe released already)
        while not rows.grow(req, req.scheduled + 1):
            # A retraction still waiting on its batch in flight frees pages next step;
            # retracting more now would throw away work it alone may cover.
            if any(r.retracting for r in rows.live.values()):
                break
            younger = [r for r in active[active.index(req) + 1:] if not r.retracting]
            if not younger:
                break
            core.retract(younger[-1])
        if len(req.pages) * core.cfg.page_size <= req.scheduled:
            continue  # no page this step; pages come back when retracted rows report
        plan.add(req, 1, True, pool)
        budget -= 1

    for req in sorted((r for r in active if r.state == State.PREFILLING and not r.retracting),
                      key=lambda r: r.admitted_at or 0.0):
        if budget <= 0:
            break
        chunk = min(req.prefill_target - req.scheduled, budget)
        plan.add(req, chunk, req.scheduled + chunk == req.prefill_target, pool)
        budget -= chunk

    reserve = len(decoding)  # one page of headroom per decoding row before admitting more
    ps = core.cfg.page_size
    # Until its last chunk reports back (computed, not merely scheduled), a prefix is
    # not in the tree yet.
    in_prefill = {_prefix_key(r, ps) for r in rows.live.values() if r.computed < r.prefill_target}
    for req, blocking in admission_order(core.waiting, now, core.cfg.aging_s, rows.match):
        if budget <= 0 or not rows.free_rows:
            break
        key = _prefix_key(req, ps)
        if key is not None and key in in_prefill and rows.tree is not None:
            # A row is prefilling this very prefix right now: admitted next to it, this
            # request would compute it again; once it is published, it adopts it instead.
            # Aged requests wait too: the wait is bounded by one prefill.
            continue
        first = req.admitted_at is None
        if not rows.admit(req, now, reserve):
            if blocking:
                break
            continue
        core.waiting.remove(req)
        if first:
            core.totals.prompt_tokens += len(req.prompt)
            core.totals.cached_prompt_tokens += req.cached_tokens
        plan.new_rows.append(core.new_row(req))
        chunk = min(req.prefill_target - req.scheduled, budget)
        plan.add(req, chunk, req.scheduled + chunk == req.prefill_target, pool)
        budget -= chunk
        in_prefill.add(key)
    return plan


def _prefix_key(req: Request, page_size: int) -> Optional[tuple[int, ...]]:
    """The first two pages of a prompt: enough to tell requests that share a system
    prompt, short enough to be cheap. None for prompts too short to share a page."""
    n = 2 * page_size
    return tuple(req.prompt[:n]) if len(req.prompt) > n else None
