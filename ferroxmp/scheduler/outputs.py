"""Outbox: what the scheduler tells the frontend at the end of a loop turn.

Refusals and expiries are final `RowOut`s as they are made. A request with news (new
tokens, or its end) is only noted; its `RowOut` is built once per turn in `take`
(request.report), with every token it sampled since the last one sent — not rebuilt
for each token. A request's counts (prompt and cached tokens, queue time) travel with
its first RowOut that carries tokens and with its last; the ones between carry only
its new tokens. A request that ended with an error says status 500 (the worker could
not compute it); refusals carry their own 400/503.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ferroxmp.protocol import RowOut
from ferroxmp.scheduler.request import Request, report


@dataclass
class Outbox:
    finals: dict[str, RowOut] = field(default_factory=dict)  # refusals and expiries
    news: dict[str, Request] = field(default_factory=dict)  # requests with something to report

    def refuse(self, out: RowOut) -> None:
        self.finals[out.rid] = out

    def note(self, req: Request) -> None:
        self.news[req.rid] = req

    def take(self) -> list[RowOut]:
        outs = list(self.finals.values())
        self.finals.clear()
        report(self.news.values(), outs)
        self.news.clear()
        return outs
