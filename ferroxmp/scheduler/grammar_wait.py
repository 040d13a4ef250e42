"""Requests waiting for their grammar: the scheduler's side of PrepareGrammar / GrammarReady.

Job: a constrained request is not queued for admission when it arrives; the core
parks it here and asks the worker to compile its grammar (PrepareGrammar, sent by the
loop). GrammarReady releases it to the waiting queue, or ends it with a 400 naming
the engine's reason; one still pending after --max-grammar-compile-seconds ends with
a 400 naming the bound. Meanwhile every other row keeps stepping: the planner never
sees a pending request.

Invariants: a request is pending here, or in the core's `requests`, never both; every
pending request has exactly one PrepareGrammar sent; a GrammarReady for a request no
longer pending (aborted, timed out) only counts in the statistics.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from ferroxmp.protocol import GRAMMAR_COMPILE_BUCKETS, GrammarReady, PrepareGrammar, RowOut, Stats
from ferroxmp.scheduler.request import Request


@dataclass
class GrammarWait:
    bound_s: float
    pending: dict[str, tuple[Request, float]] = field(default_factory=dict)  # rid -> (request, deadline)
    outgoing: list[PrepareGrammar] = field(default_factory=list)

    def park(self, req: Request, now: float) -> None:
        self.pending[req.rid] = (req, now + self.bound_s)
        self.outgoing.append(PrepareGrammar(req.rid, req.params.grammar))

    def take_prepares(self) -> list[PrepareGrammar]:
        out, self.outgoing = self.outgoing, []
        return out

    def answer(self, msg: GrammarReady, totals: Stats) -> tuple[Optional[Request], Optional[RowOut]]:
        """(request now ready to queue, or None; its refusal, or None)."""
        if msg.cached:
            totals.grammar_cache_hits += 1
        else:
            totals.grammar_cache_misses += 1
            if not totals.grammar_compile_counts:
                totals.grammar_compile_counts = [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
            totals.grammar_compile_counts[bisect.bisect_left(GRAMMAR_COMPILE_BUCKETS, msg.compile_s)] += 1
            totals.grammar_compile_seconds += msg.compile_s
        entry = self.pending.pop(msg.rid, None)
        if entry is None:
            return None, None
        req = entry[0]
        if msg.error is not None:
            return None, RowOut(req.rid, finish_reason="error", status=400, prompt_tokens=len(req.prompt),
                                error=f"the request's grammar cannot be compiled: {msg.error}")
        return req, None

    def expired(self, now: float) -> list[RowOut]:
        """Refusals (400) of the requests whose grammar is still pending past the bound."""
        late = [rid for rid, (_, deadline) in self.pending.items() if now > deadline]
        outs = []
        for rid in late:
            req, _ = self.pending.pop(rid)
            outs.append(RowOut(rid, finish_reason="error", status=400, prompt_tokens=len(req.prompt),
                               error=f"compiling the request's grammar took longer than "
                                     f"--max-grammar-compile-seconds ({self.bound_s:g}s): simplify the "
                                     f"schema, regex or grammar"))
        return outs

    def drop(self, rid: str) -> Optional[Request]:
        entry = self.pending.pop(rid, None)
        return None if entry is None else entry[0]
