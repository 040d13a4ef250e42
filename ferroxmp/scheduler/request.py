"""A request's state and every transition it makes, in one place.

    WAITING ──admit──► PREFILLING ──last chunk sent──► DECODING ──► FINISHED
       ▲                   │                              │
       └────── retract ────┴──────────────────────────────┘

Token ids stay int32 arrays: `prompt` is the wire array itself; `tokens` adds
what was sampled (a copy only once there is output, e.g. after a retraction).
The request's hold on the KV cache is `cache`, a handle only the cache manager
(cache.py) reads or writes; the request knows its row slot through it, nothing more.

Positions: `scheduled` counts the positions whose KV has been sent to the worker
(in flight or done); `computed` those whose batch has reported back. A row's pages
and slot are released only when `inflight == 0`: a batch the worker still holds
may read them (DESIGN.md, overlap).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ferroxmp.protocol import Logprobs, SamplingParams


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # identity: queues are searched by object, and prompt is an array
class Request:
    rid: str
    prompt: np.ndarray  # int32
    params: SamplingParams
    arrival: float
    seed: int = 0
    salt: str = ""  # prefixes are shared only between requests with the same salt
    stops: frozenset = frozenset()  # sampled ids that end it with "stop" (EOS unless ignore_eos, stop_token_ids)
    output: list[int] = field(default_factory=list)
    state: State = State.WAITING
    cache: Any = None  # the cache manager's handle while the request holds a row
    cache_match: tuple[int, int, int] = (-1, -1, 0)  # the cache manager's memo: (version, known_len, tokens)
    scheduled: int = 0
    computed: int = 0
    sampled_scheduled: int = 0  # sampling steps sent; output grows as they report
    inflight: int = 0  # batches in flight that reference this row
    cached_tokens: int = 0  # adopted at first admission (reported in usage)
    admitted_at: Optional[float] = None
    queue_time: float = 0.0
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    retractions: int = 0
    retracting: bool = False  # retracted, waiting for its batches in flight to report back
    reported_tokens: int = 0  # outputs already sent to the frontend
    pending_logprobs: list[Logprobs] = field(default_factory=list)
    # Prompt logprobs not yet sent, and the prompt position the next one is for (a row
    # re-prefilled after a retraction reports positions already sent again: dropped).
    pending_prompt_logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs_next: int = 1
    prefill_target: int = 0  # positions to prefill before sampling: all tokens known at admission
    sampled_before: int = 0  # outputs that existed at (re-)admission
    embedding: bytes = b""  # an embedding row's pooled vector, from its one sampling step
    # KV tiers (tier_moves.py): the load this request waits for (not admitted meanwhile),
    # the (tree, index, length) versions it was last probed at, its pages' chain keys.
    kv_load: Optional[int] = None
    kv_probe: Optional[tuple] = None
    kv_keys: list = field(default_factory=list)

    @property
    def tokens(self) -> np.ndarray:
        """Every token whose id is known, int32: the prompt, then what was sampled."""
        if not self.output:
            return self.prompt
        return np.concatenate((self.prompt, np.asarray(self.output, dtype=np.int32)))

    @property
    def row(self) -> Optional[int]:
        return self.cache.row if self.cache is not None else None

    @property
    def known_len(self) -> int:
        return len(self.prompt) + len(self.output)

    # -- transitions ----------------------------------------------------------------

    def admit(self, handle: Any, adopted: int, now: float) -> None:
        assert self.state == State.WAITING and self.cache is None, self.state
        self.state = State.PREFILLING
        self.cache = handle
        self.scheduled = self.computed = adopted
        self.prefill_target = self.known_len
        self.sampled_before = len(self.output)
        self.sampled_scheduled = 0
        if self.admitted_at is None:
            self.admitted_at = now
            self.queue_time = now - self.arrival
            self.cached_tokens = adopted

    def schedule(self, length: int, sample: bool) -> None:
        self.scheduled += length
        self.inflight += 1
        if sample:
            self.sampled_scheduled += 1
        if self.state == State.PREFILLING and self.scheduled >= self.prefill_target:
            self.state = State.DECODING

    def retract(self) -> None:
        """Back to WAITING, keeping its output: re-admission re-prefills prompt + output."""
        assert self.inflight == 0 and self.cache is None
        self.state = State.WAITING
        self.scheduled = self.computed = 0
        self.retractions += 1
        self.retracting = False

    def finish(self, reason: str, error: Optional[str] = None) -> None:
        if self.state != State.FINISHED:
            self.state = State.FINISHED
            self.finish_reason = reason
            self.error = error


def schedule_decode(reqs: list[Request]) -> tuple[list[int], list[int]]:
    """`schedule(1, True)` for many DECODING rows at once (every step, every decode row:
    one pass, no call per row). Returns their rows and the positions they compute."""
    rows, starts = [], []
    for req in reqs:
        start = req.scheduled
        rows.append(req.cache.row)
        starts.append(start)
        req.scheduled = start + 1
        req.inflight += 1
        req.sampled_scheduled += 1
    return rows, starts
