"""A request's state and every transition it makes, in one place.

    WAITING ──admit──► PREFILLING ──last chunk sent──► DECODING ──► FINISHED
       ▲                   │                              │
       └────── retract ────┴──────────────────────────────┘

Token ids stay int32: `prompt` is the wire array itself, copied once into `ids`
(token_ids.TokenIds), which grows in place as tokens are sampled; `tokens` and
`output` are views of it, never copies.
The request's hold on the KV cache is `cache`, a handle only the cache manager
(cache.py) reads; the request knows its row slot through it, nothing more.

One writer: every field below is written only by the methods of this class (the
transitions), called by the core and its helpers (results.py, outputs.py, the cache
manager's admit/release); nothing outside assigns a field. What the cache manager
remembers of a request (its match memo, tier probes, chain keys) is the cache
manager's own state (cache.py `Memo`), not the request's.

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

from ferroxmp.protocol import Logprobs, RowOut, SamplingParams
from ferroxmp.token_ids import PACK1, TokenIds


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
    ids: TokenIds = None  # type: ignore[assignment]  # prompt + output (__post_init__)
    n_prompt: int = 0  # len(prompt), a constant kept as an int: the per-row, per-step checks read it
    state: State = State.WAITING
    cache: Any = None  # the cache manager's handle while the request holds a row
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
    kv_load: Optional[int] = None  # KV tiers: the load it waits for (not admitted meanwhile)

    def __post_init__(self) -> None:
        self.ids = TokenIds(self.prompt)
        self.n_prompt = len(self.prompt)

    @property
    def n_output(self) -> int:
        """Tokens sampled (an int: the per-row, per-step checks read it, not a view)."""
        return self.ids.n - self.n_prompt

    @property
    def tokens(self) -> np.ndarray:
        """Every token whose id is known, int32: the prompt, then what was sampled (a view)."""
        return self.ids.array

    @property
    def output(self) -> np.ndarray:
        """What was sampled, int32 (a view)."""
        return self.ids.array[len(self.prompt):]

    @property
    def row(self) -> Optional[int]:
        return self.cache.row if self.cache is not None else None

    @property
    def known_len(self) -> int:
        return len(self.ids)

    # -- transitions ----------------------------------------------------------------

    def admit(self, handle: Any, adopted: int, now: float) -> None:
        assert self.state == State.WAITING and self.cache is None, self.state
        self.state = State.PREFILLING
        self.cache = handle
        self.scheduled = self.computed = adopted
        self.prefill_target = self.known_len
        self.sampled_before = self.n_output
        self.sampled_scheduled = 0
        if self.admitted_at is None:
            self.admitted_at = now
            self.queue_time = now - self.arrival
            self.cached_tokens = adopted

    def schedule(self, length: int, sample: bool) -> None:
        assert self.state in (State.PREFILLING, State.DECODING) and self.cache is not None, self.state
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

    def released(self) -> None:
        """The cache manager took its row and pages back (cache.py `release`)."""
        assert self.inflight == 0, (self.rid, self.inflight)  # a batch in flight may still read them
        self.cache = None

    def start_retract(self) -> None:
        """Chosen to give its pages back; it returns to WAITING once no batch names it."""
        assert self.state in (State.PREFILLING, State.DECODING) and not self.retracting, self.state
        self.retracting = True

    def wait_for_load(self, load_id: int) -> None:
        self.kv_load = load_id

    def load_over(self) -> None:
        """Its load arrived or is overdue: admissible again (a late load's pages are recomputed)."""
        self.kv_load = None

    def reported(self, end: Optional[int]) -> None:
        """A batch naming this row reported back; positions before `end` are computed (None:
        the row failed there). An errored row's KV is not trusted: never extended."""
        assert self.inflight > 0, self.rid  # a result for a batch that did not name it
        self.inflight -= 1
        if end is not None and end > self.computed and self.finish_reason != "error":
            self.computed = end

    def decoded(self, start: int, token: int, logprobs: Optional[Logprobs]) -> bool:
        """A decode step at `start` reported back with its token: `reported(start + 1)`, then
        `add_token` unless the request ended meanwhile (the token is dropped: False)."""
        self.reported(start + 1)
        if self.state is State.FINISHED:
            return False
        self.add_token(token, logprobs)
        return True

    def add_token(self, token: int, logprobs: Optional[Logprobs] = None) -> None:
        """A sampled token (its logprobs, if asked): it may end the request."""
        assert self.state is not State.FINISHED, self.rid  # a finished row's late token is dropped
        ids = self.ids
        ids.append(token)
        if logprobs is not None:
            self.pending_logprobs.append(logprobs)
        if int(token) in self.stops:
            self.finish("stop")
        elif ids.n - self.n_prompt >= self.params.max_tokens:
            self.finish("length")

    def accept_drafts(self, start: int, extra: np.ndarray) -> int:
        """The draft tokens the worker accepted after the row's sampled one (decode step at
        `start`): appended in order up to a stop or max_tokens, and the row moved past them:
        their positions' KV is computed. Safe only because no batch is planned behind one
        that gave its rows a budget (core.lookahead_inflight). Returns tokens appended."""
        n = 0
        for token in extra:
            if self.state is State.FINISHED:
                break
            self.add_token(token)
            n += 1
        self.computed = self.scheduled = start + 1 + len(extra)
        self.sampled_scheduled += len(extra)
        return n

    def add_prompt_logprobs(self, first: int, lps: list) -> None:
        """Keep, in order, the entries for prompt positions not reported yet; they travel
        with the request's next RowOut (the one carrying its first token)."""
        skip = self.prompt_logprobs_next - first
        if 0 <= skip < len(lps):
            self.pending_prompt_logprobs.extend(lps[skip:])
            self.prompt_logprobs_next = first + len(lps)

    def pooled(self, vec: bytes) -> None:
        """An embedding row's vector: it travels with the RowOut that ends it (max_tokens 1)."""
        self.embedding = vec

    def take_report(self) -> Optional[RowOut]:
        """Everything not reported yet as one RowOut (None: nothing new), now counted as
        reported. It carries the request's counts: it is the first with tokens or the last
        (a decoding row's other reports are `report`'s inline (rid, token))."""
        if self.n_output == self.reported_tokens and self.state != State.FINISHED:
            return None
        ids = self.ids.packed(self.n_prompt + self.reported_tokens)
        lps = self.pending_logprobs or None
        self.reported_tokens = self.n_output
        # Positional (RowOut's field order): this runs once per row per step.
        out = RowOut(self.rid, ids, lps, self.finish_reason, self.error,
                     500 if self.finish_reason == "error" else 200,
                     len(self.prompt), self.cached_tokens, self.queue_time)
        if self.embedding:
            out.embedding = self.embedding
        if self.pending_prompt_logprobs:
            out.prompt_logprobs = self.pending_prompt_logprobs
        self.pending_logprobs, self.pending_prompt_logprobs = [], []
        return out

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


def decoded_many(reqs: list[Request], starts: list[int], tokens: list[int],
                 news: dict[str, "Request"]) -> tuple[int, list[Request]]:
    """`decoded(start, token, None)` for every decode row of a batch, in one pass (the
    step's common case: no logprobs, no drafts). The bodies of `reported` and
    `add_token` are written out here because this runs for every decoding row every
    step and a call costs as much as the work (tools/bench_scheduler.py (a));
    `test_scheduler_core.py` checks it against the per-row transitions. Rows with news
    go into `news` (the outbox's map); returns (tokens appended, requests that ended:
    no batch in flight names them and they are finished or retracting)."""
    finished = State.FINISHED
    ended = []
    n = 0
    for req, start, token in zip(reqs, starts, tokens):
        req.inflight -= 1  # InFlight named it (core.check_integrity recounts inflight)
        if req.state is not finished:  # (only a finished request can have ended in error)
            if start >= req.computed:
                req.computed = start + 1
            ids = req.ids
            m = ids.n
            if m == ids._cap:
                ids._reserve(1)
            ids._mv[m] = token
            ids.n = m + 1
            ids.last = token
            n += 1
            news[req.rid] = req
            if token in req.stops:
                req.finish("stop")
            elif m + 1 - req.n_prompt >= req.params.max_tokens:
                req.finish("length")
            if req.inflight == 0 and (req.state is finished or req.retracting):
                ended.append(req)
            continue
        if start >= req.computed and req.finish_reason != "error":
            req.computed = start + 1  # ended while this batch was in flight: its token is dropped
        if req.inflight == 0:
            ended.append(req)
    return n, ended


def report(reqs, outs: list[RowOut]) -> None:
    """`take_report` for each request with news, appended to `outs`. The common case is
    written out (one more token, nothing else to say: a decoding row every step), without
    a call per row, as only (rid, token): the request's counts went with its first token
    and go again with its last (tools/bench_scheduler.py (a))."""
    finished = State.FINISHED
    for req in reqs:
        k = req.reported_tokens
        ids = req.ids
        if (ids.n - req.n_prompt == k + 1 and k > 0 and req.state is not finished
                and not req.pending_logprobs and not req.pending_prompt_logprobs):
            req.reported_tokens = k + 1
            outs.append(RowOut(req.rid, PACK1(ids.last)))
        elif (out := req.take_report()) is not None:
            outs.append(out)
