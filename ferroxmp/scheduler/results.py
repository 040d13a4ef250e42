"""Applying a batch's result to its requests (the core releases what this returns).

Two paths, one outcome. `apply_decode` takes the decode rows of a result that
reports them first and in step order (the worker keeps step order), in one pass:
per row a few counters, the token, a stop check and a note in the outbox; a
request is touched further only when it ends. `apply_steps` goes row by row and
handles everything else: prefill chunks (which publish what they computed),
prompt logprobs, row errors, a batch refused whole, rows out of order.
`test_scheduler_core.py` drives both over the same traffic and compares.

Both return (tokens appended, requests that may be released now: finished or
retracting, with no batch in flight naming them).
"""
from __future__ import annotations

import logging

from ferroxmp.protocol import BatchResult, RowStep, unpack_ids
from ferroxmp.scheduler.cache import CacheManager
from ferroxmp.scheduler.inflight import InFlight
from ferroxmp.scheduler.request import Request, State, decoded_many

log = logging.getLogger("ferroxmp.scheduler")


def apply_decode(batch: InFlight, tokens: list[int], logprobs: dict,
                 news: dict[str, Request], spec: dict[int, bytes] = {}) -> tuple[int, list[Request]]:
    """`news` is the outbox's rid -> request map (noted without a call per row); `spec`
    the accepted draft tokens by row (--speculative-ngram)."""
    if not logprobs and not spec:  # the common step, without a lookup per row
        return decoded_many(batch.decode, batch.starts, tokens, news)
    finished = State.FINISHED
    ended = []
    n = 0
    for req, row, start, token in zip(batch.decode, batch.rows, batch.starts, tokens):
        if req.decoded(start, token, logprobs.get(row) if logprobs else None):
            n += 1
            if spec and row in spec:
                n += req.accept_drafts(start, unpack_ids(spec[row]))
            news[req.rid] = req
        if req.inflight == 0 and (req.state is finished or req.retracting):
            ended.append(req)
    return n, ended


def apply_steps(res: BatchResult, steps: list[tuple[Request, RowStep]], cache: CacheManager,
                news: dict[str, Request]) -> tuple[int, list[Request]]:
    row_errors, logprobs = res.row_errors, res.logprobs
    failed = res.error is not None or bool(row_errors)
    sampled = dict(zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist()))
    n = 0
    for req, step in steps:
        if failed and (why := res.error or row_errors.get(step.row)) is not None:
            req.reported(None)
            if req.state != State.FINISHED:
                log.error("request %s failed in batch %d: %s", req.rid, res.batch_id, why)
                req.finish("error", f"the model worker failed this request: {why}")
                news[req.rid] = req
            continue
        req.reported(step.start + step.length)
        if req.finish_reason == "error":
            continue  # its KV is not trusted any more: never published, never extended
        if res.prompt_logprobs and (plps := res.prompt_logprobs.get(step.row)):
            req.add_prompt_logprobs(step.start + 1, plps)
        if step.start < req.prefill_target and req.state != State.FINISHED and not req.retracting:
            cache.publish(req)  # a finished prefill chunk is shared at once (contract 1)
        if step.sample and req.state != State.FINISHED:
            token = sampled.get(step.row)
            if token is None:
                req.finish("error", f"the model worker returned no token for row {step.row}")
                news[req.rid] = req
                continue
            if res.embeddings and (vec := res.embeddings.get(step.row)) is not None:
                req.pooled(vec)
            req.add_token(token, logprobs.get(step.row) if logprobs else None)
            n += 1
            if res.spec_tokens and step.row in res.spec_tokens:
                n += req.accept_drafts(step.start, unpack_ids(res.spec_tokens[step.row]))
            news[req.rid] = req
    ended = [req for req, _ in steps
             if req.inflight == 0 and (req.state is State.FINISHED or req.retracting)]
    return n, ended

