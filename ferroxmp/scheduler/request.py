"""A request's state and every transition it makes, in one place.

    WAITING ──admit──► PREFILLING ──last chunk sent──► DECODING ──► FINISHED
       ▲                   │                              │
       └────── retract ────┴──────────────────────────────┘

Positions: `scheduled` counts the positions whose KV has been sent to the worker
(in flight or done); `computed` those whose batch has reported back. A row's pages
and slot are released only when `inflight == 0`: a batch the worker still holds
may read them (DESIGN.md, overlap).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from ferroxmp.protocol import Logprobs, SamplingParams


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: float
    seed: int = 0
    output: list[int] = field(default_factory=list)
    state: State = State.WAITING
    row: Optional[int] = None
    pages: list[int] = field(default_factory=list)  # one ref held on each, position order
    lock_node: Any = None  # radix node locked while the row reads adopted pages
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
    released_window_pages: bool = False  # sliding window freed early pages: can't publish all
    reported_tokens: int = 0  # outputs already sent to the frontend
    pending_logprobs: list[Logprobs] = field(default_factory=list)
    prefill_target: int = 0  # positions to prefill before sampling: all tokens known at admission
    sampled_before: int = 0  # outputs that existed at (re-)admission

    @property
    def tokens(self) -> list[int]:
        """Every token whose id is known: the prompt, then what was sampled."""
        return self.prompt + self.output

    @property
    def known_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done_sampling(self) -> bool:
        return self.sampled_scheduled + self.sampled_before >= self.params.max_tokens

    # -- transitions ----------------------------------------------------------------

    def admit(self, row: int, adopted: int, now: float) -> None:
        assert self.state == State.WAITING, self.state
        self.state = State.PREFILLING
        self.row = row
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
        assert self.inflight == 0
        self.state = State.WAITING
        self.row = None
        self.pages = []
        self.lock_node = None
        self.scheduled = self.computed = 0
        self.retractions += 1
        self.retracting = False
        self.released_window_pages = False

    def finish(self, reason: str, error: Optional[str] = None) -> None:
        if self.state != State.FINISHED:
            self.state = State.FINISHED
            self.finish_reason = reason
            self.error = error
