"""Generation: one HTTP request's choices, from GenerateReqs to text deltas.

A request with P prompts and n choices each becomes P*n GenerateReqs (rid
`<request id>-<i>`, seed+i when seeded) sharing one queue. `deltas()` waits on
that queue and turns each RowOut into a Delta per choice: new token ids, their
logprobs, and the text released by that choice's Detokenizer and StopMatcher.

Invariants: every wait has a timeout, after which the client (disconnected ->
ClientGone) and the bridge (Shutdown -> 503) are re-checked, so no thread waits
forever once the client leaves or a process dies. A silent scheduler is waited
for: a stall costs latency, and one past --stall-timeout is stopped by the
supervisor, which then sends the Shutdown; a refusal RowOut becomes the ApiError it names; a
matched stop string finishes the choice with "stop" and sends AbortReq(rid,
"stop"); `close()` (always called, even on errors and disconnects) aborts every
unfinished choice and unroutes every rid exactly once.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import msgspec

from ferroxmp.frontend.bridge import SHUTDOWN, Bridge
from ferroxmp.frontend.text.detokenizer import Detokenizer, StopMatcher
from ferroxmp.frontend.errors import ApiError
from ferroxmp.frontend.metrics import Metrics
from ferroxmp.protocol import GenerateReq, Logprobs, RowOut, SamplingParams, pack_ids, unpack_id_list

log = logging.getLogger("ferroxmp.frontend")

POLL_S = 0.25  # how often a waiting request re-checks its client and the scheduler
CONTEXT_TOKENS = 4  # prompt tail decoded with the output so the first token gets its leading space


class ClientGone(Exception):
    """The HTTP client disconnected; its rows were aborted and nobody reads the answer."""


@dataclass
class TokenInfo:
    token_id: int
    logprobs: Optional[Logprobs]


@dataclass
class Delta:
    index: int
    text: str
    tokens: list[TokenInfo]
    finish_reason: Optional[str] = None
    prompt_logprobs: list[Logprobs] = field(default_factory=list)  # prompt positions 1.., in order
    reasoning: str = ""  # with --reasoning-parser: the thinking part; `text` is then the answer only


@dataclass
class Choice:
    index: int
    rid: str
    detok: Detokenizer
    stop: StopMatcher
    n_tokens: int = 0
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_token_at: Optional[float] = None
    embedding: bytes = b""  # an embedding row's pooled vector (RowOut.embedding)
    reasoning: Any = None  # its reasoning.ReasoningSplitter, with --reasoning-parser

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Generation:
    bridge: Bridge
    metrics: Metrics
    decode: Optional[Callable[[list[int]], str]]  # None: ids only (/generate), no text
    request_id: str
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per prompt
    n: int = 1
    stops: list[str] = field(default_factory=list)
    is_disconnected: Callable[[], bool] = lambda: False
    cache_salt: str = ""  # prefixes are shared only between requests with the same salt
    reasoning: Optional[Callable[[], Any]] = None  # a fresh reasoning.ReasoningSplitter per choice
    arrival: float = field(default_factory=time.time)
    choices: list[Choice] = field(default_factory=list)
    _q: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _by_rid: dict = field(default_factory=dict)
    _checked_at: float = 0.0
    _closed: bool = False

    def start(self) -> None:
        reqs = []
        for p, (ids, params) in enumerate(zip(self.prompts, self.params)):
            for j in range(self.n):
                i = p * self.n + j
                rid = f"{self.request_id}-{i}"
                detok = Detokenizer.with_context(self.decode or _no_text, ids[-CONTEXT_TOKENS:])
                self.choices.append(Choice(i, rid, detok,
                                           StopMatcher(list(self.stops)), prompt_tokens=len(ids)))
                sp = params if params.seed is None or j == 0 else _with_seed(params, params.seed + j)
                reqs.append(GenerateReq(rid=rid, input_ids=pack_ids(ids), params=sp, arrival=self.arrival,
                                        cache_salt=self.cache_salt))
        self._by_rid = {c.rid: c for c in self.choices}
        if self.reasoning is not None:
            for c in self.choices:
                c.reasoning = self.reasoning()
        self.bridge.submit(reqs, self._q)

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    @property
    def usage(self) -> dict:
        prompt = sum(c.prompt_tokens for c in self.choices[::self.n])
        completion = sum(c.n_tokens for c in self.choices)
        cached = sum(c.cached_tokens for c in self.choices[::self.n])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def deltas(self) -> Iterator[Delta]:
        """Yield deltas until every choice finished; raise ApiError or ClientGone."""
        while not self.done:
            out = self._next()
            choice = self._by_rid.get(out.rid)
            if choice is None or choice.done:
                continue  # e.g. the scheduler's answer to our own stop abort
            if out.finish_reason == "error":
                status = out.status if out.status >= 400 else 500
                log.error("rid=%s refused (%d): %s", out.rid, status, out.error)
                self._finish(choice, "error")
                raise ApiError(status, out.error or "the request failed in the scheduler",
                               code="refused" if status < 500 else "unavailable")
            delta = self._apply(choice, out)
            if choice.reasoning is not None:  # the split every dialect reads (reasoning.py)
                delta.reasoning, delta.text = choice.reasoning.feed(delta.text)
                if delta.finish_reason is not None:
                    r, t = choice.reasoning.finish()
                    delta.reasoning, delta.text = delta.reasoning + r, delta.text + t
            if delta.text or delta.tokens or delta.finish_reason or delta.prompt_logprobs:
                yield delta

    def _next(self) -> RowOut:
        while True:
            try:
                item = self._q.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            if item is SHUTDOWN or self.bridge.dead_reason is not None:
                raise ApiError(503, f"the server is shutting down ({self.bridge.dead_reason})",
                               code="shutting_down")
            now = time.monotonic()
            if item is None or now - self._checked_at >= POLL_S:
                # Checked on a clock, not only when idle: a busy stream must notice too.
                self._checked_at = now
                if self.is_disconnected():
                    raise ClientGone()
            if item is not None:
                return item

    def _apply(self, c: Choice, out: RowOut) -> Delta:
        now = time.time()
        ids = unpack_id_list(out.token_ids)
        if out.prompt_tokens:
            c.prompt_tokens, c.cached_tokens = out.prompt_tokens, out.cached_tokens
        if out.embedding:
            c.embedding = out.embedding
        if ids:
            if c.last_token_at is None:
                self.metrics.ttft.observe(max(0.0, now - self.arrival))
                self.metrics.queue_time.observe(max(0.0, out.queue_time))
            else:
                self.metrics.itl.observe(max(0.0, now - c.last_token_at) / len(ids))
            c.last_token_at = now
        pieces, tokens = [], []
        lps = out.logprobs or []
        plps = out.prompt_logprobs or []
        for k, t in enumerate(ids):
            tokens.append(TokenInfo(t, lps[k] if k < len(lps) else None))
            c.n_tokens += 1
            if self.decode is None:
                continue
            pieces.append(c.stop.feed(c.detok.feed([t])))
            if c.stop.stopped:
                self.bridge.abort(c.rid, "stop")
                self._finish(c, "stop")
                return Delta(c.index, "".join(pieces), tokens, "stop", plps)
        if out.finish_reason is not None and self.decode is None:
            self._finish(c, out.finish_reason)
            return Delta(c.index, "", tokens, out.finish_reason, plps)
        if out.finish_reason is not None:
            pieces.append(c.stop.feed(c.detok.finish()))
            reason = "stop" if c.stop.stopped else out.finish_reason
            if not c.stop.stopped:
                pieces.append(c.stop.finish())
            self._finish(c, reason)
            return Delta(c.index, "".join(pieces), tokens, reason, plps)
        return Delta(c.index, "".join(pieces), tokens, prompt_logprobs=plps)

    def _finish(self, c: Choice, reason: str) -> None:
        c.finish_reason = reason
        self.bridge.release([c.rid])
        self.metrics.requests.labels(reason).inc()
        if reason != "error":
            self.metrics.e2e.observe(max(0.0, time.time() - self.arrival))

    def close(self) -> None:
        """Abort what is unfinished (client gone, error, shutdown) and unroute every rid."""
        if self._closed:
            return
        self._closed = True
        for c in self.choices:
            if not c.done:
                if self.bridge.dead_reason is None:
                    self.bridge.abort(c.rid, "abort")
                self._finish(c, "abort")
        self.bridge.release(c.rid for c in self.choices)


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return msgspec.structs.replace(p, seed=seed)


def _no_text(ids: list[int]) -> str:
    return ""


class StreamBody:
    """A streamed response body; `close()` (which WSGI servers always call, also when the
    client went away or iteration never started) releases the request exactly once."""

    def __init__(self, state, gen: "Generation", events):
        self.state, self.gen, self.events = state, gen, events
        self._released = False

    def __iter__(self):
        return self.events

    def close(self) -> None:
        try:
            self.events.close()
        finally:
            if not self._released:
                self._released = True
                self.gen.close()
                self.state.end()
