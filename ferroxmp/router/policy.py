"""Routing policies: which healthy backend gets the next request.

A backend offers `load` (requests it is working on), `routed` (requests sent to
it so far) and `tree` (the PrefixTree of what was sent to it). Ties in load go
to the backend that was sent the fewest requests, so a quiet router still
spreads new work instead of always picking the first backend.

cache-aware: the backend whose tree holds the longest prefix of the request
(at least `cache_threshold` of its blocks) gets it, because its server most
likely still has those tokens' KV cached; unless it is overloaded, i.e. its
load exceeds the least loaded backend's by more than `balance_abs_threshold`
requests and by more than `balance_rel_threshold` times. Then, and when nothing
matches well enough, the least loaded backend gets it: the cache is worth a
shorter prefill, not a queue.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

POLICIES = ("cache-aware", "round-robin", "least-loaded")


@dataclass(frozen=True)
class Decision:
    backend: Any
    affinity: bool = False  # chosen because its tree held the prefix


def least_loaded(candidates: Sequence) -> Any:
    return min(candidates, key=lambda b: (b.load, b.routed))


@dataclass
class RoundRobin:
    name = "round-robin"
    _turn: itertools.count = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def choose(self, candidates: Sequence, block_ids: list[int]) -> Decision:
        with self._lock:
            return Decision(candidates[next(self._turn) % len(candidates)])


@dataclass
class LeastLoaded:
    name = "least-loaded"

    def choose(self, candidates: Sequence, block_ids: list[int]) -> Decision:
        return Decision(least_loaded(candidates))


@dataclass
class CacheAware:
    name = "cache-aware"
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")

    def overloaded(self, load: float, least: float) -> bool:
        return load - least > self.balance_abs_threshold and load > least * self.balance_rel_threshold

    def choose(self, candidates: Sequence, block_ids: list[int]) -> Decision:
        least = least_loaded(candidates)
        if not block_ids:
            return Decision(least)
        matched = {id(b): b.tree.match(block_ids) for b in candidates}
        best = max(candidates, key=lambda b: (matched[id(b)], -b.load, -b.routed))
        n = matched[id(best)]
        if n == 0 or n < self.cache_threshold * len(block_ids) or self.overloaded(best.load, least.load):
            return Decision(least)
        return Decision(best, affinity=True)


def make_policy(name: str, balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.5,
                cache_threshold: float = 0.3):
    if name == "cache-aware":
        return CacheAware(balance_abs_threshold, balance_rel_threshold, cache_threshold)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    raise ValueError(f"unknown policy {name!r}; one of {', '.join(POLICIES)}")
