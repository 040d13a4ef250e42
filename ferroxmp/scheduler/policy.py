"""Admission order: retracted rows first, then the aged (FCFS), then the longest
cached prefix first.

Cache-aware order packs requests that share a prefix into the same window of
time, while the tree still holds it. Aging bounds what that costs anyone: a
request waiting longer than `aging_s` is taken strictly by arrival, and while an
aged request cannot fit (or waits one chunk for a prefix a row is computing),
nothing younger is admitted past it, so running rows drain until it does (the
queue timeout bounds the rest). `match` is the cache manager's remembered, pure
read, so ordering a queue costs a tree walk only for requests the tree moved under.
"""
from __future__ import annotations

from typing import Callable

from ferroxmp.scheduler.request import Request

# A match may cost a tree walk (after the tree changed); past this many, the tail
# keeps arrival order.
MAX_SORTED = 128


def admission_order(waiting: list[Request], now: float, aging_s: float,
                    match: Callable[[Request], int]) -> list[tuple[Request, bool]]:
    """Candidates in the order admission should try them, each with `blocking`: if it
    does not fit, stop admitting anything after it."""
    retracted = [r for r in waiting if r.retractions > 0]
    aged = [r for r in waiting if r.retractions == 0 and now - r.arrival >= aging_s]
    rest = [r for r in waiting if r.retractions == 0 and now - r.arrival < aging_s]
    retracted.sort(key=lambda r: r.arrival)
    aged.sort(key=lambda r: r.arrival)
    head, tail = rest[:MAX_SORTED], rest[MAX_SORTED:]
    if len(head) > 1:
        scored = [(-match(r), r.arrival, i) for i, r in enumerate(head)]
        scored.sort()
        head = [head[i] for _, _, i in scored]
    return ([(r, True) for r in retracted] + [(r, True) for r in aged]
            + [(r, False) for r in head + tail])
