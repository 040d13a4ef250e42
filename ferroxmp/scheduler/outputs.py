"""Outbox: what the scheduler tells the frontend at the end of a loop turn.

Refusals and expiries are final `RowOut`s as they are made. A request's counts
(prompt and cached tokens, queue time) travel with its first RowOut that carries
tokens and with its last; the ones between carry only its new tokens. A request with news
(new tokens, or its end) is only noted; its `RowOut` is built once per turn in
`take`, with every token it sampled since the last one sent — not rebuilt for each
token. A request that ended with an error says status 500 (the worker could not
compute it); refusals carry their own 400/503.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ferroxmp.protocol import RowOut
from ferroxmp.scheduler.request import Request, State


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
        finished = State.FINISHED
        for req in self.news.values():
            # The common case inline (one more token, nothing else to say): a decoding
            # row's news every step, so no call per row, and only (rid, token): the
            # request's counts went with its first token and go again with its last.
            k = req.reported_tokens
            if (req.ids.n - len(req.prompt) == k + 1 and k > 0 and req.state is not finished
                    and not req.pending_logprobs and not req.pending_prompt_logprobs):
                outs.append(RowOut(req.rid, req.report_one()))
                continue
            out = _row_out(req)
            if out is not None:
                outs.append(out)
        self.news.clear()
        return outs


def _row_out(req: Request):
    if req.n_output == req.reported_tokens and req.state != State.FINISHED:
        return None
    ids, lps, plps = req.take_report()
    # Positional (RowOut's field order): this runs once per row per step.
    out = RowOut(req.rid, ids, lps, req.finish_reason, req.error,
                 500 if req.finish_reason == "error" else 200,
                 len(req.prompt), req.cached_tokens, req.queue_time)
    if req.embedding:
        out.embedding = req.embedding
    if plps:
        out.prompt_logprobs = plps
    return out
