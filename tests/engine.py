"""LocalEngine: the real scheduler core and the real model runner in one process.

Used by tests that must drive the real path (admission → chunked prefill →
handover → finish) while inspecting the pool and the tree between steps. With
`overlap=True` it keeps two batches in flight exactly as the scheduler process
does: batch N+1 is built before N's result is processed.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

import msgspec
import torch

from ferroxmp.gpu_worker.runner import ModelRunner
from ferroxmp.protocol import ForwardBatch, GenerateReq, SamplingParams, pack_ids, unpack_ids
from ferroxmp.page_pool import PagePool
from ferroxmp.scheduler.core import SchedulerConfig, SchedulerCore
from ferroxmp.scheduler.request import Request


class LocalEngine:
    def __init__(self, model: str, num_pages: int = 64, page_size: int = 4, max_batch_tokens: int = 64,
                 max_rows: int = 8, overlap: bool = False, radix: bool = True, max_model_len: int = 1024,
                 swa_release_interval: int = 32, kv_host_bytes: int = 0, kv_dir: Optional[str] = None,
                 deterministic: bool = False, spec_tokens: int = 0, draft_model: Optional[str] = None,
                 draft_quantization: str = "auto", decode_steps: int = 1):
        self.pool = PagePool.create(num_pages, max_rows, -(-max_model_len // page_size))
        # draft_model (--draft-model) drafts instead of prompt lookup when spec_tokens > 0
        # (--decode-steps: a step's further tokens have no logits kept; sample_logits stays empty)
        self.runner = ModelRunner(model, self.pool, page_size, keep_logits=decode_steps == 1,
                                  deterministic=deterministic, draft_model=draft_model,
                                  draft_quantization=draft_quantization, decode_steps=decode_steps)
        cfg = self.runner.config
        self.core = SchedulerCore(self.pool, SchedulerConfig(
            page_size=page_size, max_batch_tokens=max_batch_tokens, max_model_len=max_model_len,
            vocab_size=cfg.vocab_size, eos_token_ids=tuple(cfg.eos_token_ids), radix=radix,
            sliding_window=cfg.sliding_window, swa_release_interval=swa_release_interval,
            kv_host=kv_host_bytes > 0, kv_disk=kv_dir is not None,
            spec_tokens=spec_tokens or self.runner.decode_steps - 1, decode_steps=self.runner.decode_steps > 1))
        # The worker's KV tiers in this process: their threads report into `tier_msgs`,
        # which `build` hands to the core as the scheduler process would.
        self.tiers, self.tier_msgs = None, []
        if kv_host_bytes or kv_dir:
            from ferroxmp.gpu_worker.kv.disk import open_disk_tier
            from ferroxmp.gpu_worker.kv.tiers import KVTiers
            kv = self.runner.kv
            per_page = 2 * kv.num_layers * kv.page_size * kv.num_kv_heads * kv.head_dim * kv.k.element_size()
            disk = open_disk_tier(kv_dir, {"model": model, "page_size": page_size}, 1.0, per_page)
            self.tiers = KVTiers(kv, kv_host_bytes, disk, lambda: self.tier_msgs.append)
            self.core.kv_report(self.tiers.initial_report())
        self.overlap = overlap
        self.queue: deque[ForwardBatch] = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.refusals: dict[str, tuple[int, str]] = {}
        self.sample_logits: dict[str, list[torch.Tensor]] = {}  # rid -> logits of each sample
        self.batches: list[ForwardBatch] = []
        self.fail_next_row = False  # the next result reports its first row as not computed
        self._n = 0

    def submit(self, prompt: list[int], max_tokens: int = 4, rid: Optional[str] = None,
               cache_salt: str = "", **params) -> str:
        rid = rid or f"req-{self._n}"
        self._n += 1
        params.setdefault("temperature", 0.0)
        msg = GenerateReq(rid, pack_ids(prompt), SamplingParams(max_tokens=max_tokens, **params), time.time(),
                          cache_salt=cache_salt)
        refusal = self.core.add_request(msg, time.time())
        if refusal is not None:
            self.refusals[rid] = (refusal.status, refusal.error)
        else:
            self.outputs[rid] = []
        return rid

    def request(self, rid: str) -> Optional[Request]:
        return self.core.requests.get(rid)

    def build(self) -> Optional[ForwardBatch]:
        """Plan one batch now and queue it for the next `step` (to inspect it first).
        Grammars the core asked for are compiled inline first (the worker's compile
        thread, grammar_prep.py), so a constrained request is planned as in a server."""
        from ferroxmp.gpu_worker.sampling.grammar_prep import prepare
        for prep in self.core.grammars.take_prepares():
            self.core.grammar_ready(prepare(self.runner.grammars, prep))
        batch = self.core.build_batch(time.time())
        self.move_kv()
        if batch is not None:
            self.queue.append(batch)
            self.batches.append(batch)
        return batch

    def move_kv(self) -> None:
        """Run the core's KV saves/loads/flushes now (before any batch that may reuse the
        pages), wait for the tiers' threads, and hand their reports to the core."""
        if self.tiers is None:
            return
        for op in self.core.take_kv_ops():
            report = self.tiers.handle(op)
            if report is not None:
                self.core.kv_report(report)
        self.tiers.drain()
        from ferroxmp.protocol import KVLoaded
        msgs, self.tier_msgs[:] = list(self.tier_msgs), []
        for msg in msgs:
            if isinstance(msg, KVLoaded):
                self.core.kv_loaded(msg)
            else:
                self.core.kv_report(msg)

    def step(self) -> bool:
        """Build (up to the in-flight limit) and run one batch. False when nothing ran."""
        limit = 2 if self.overlap else 1
        while len(self.queue) < limit and not self.core.lookahead_inflight and self.build() is not None:
            pass
        if not self.queue:
            return False
        batch = self.queue.popleft()
        result = self.runner.execute(batch)
        if self.fail_next_row and result.error is None and batch.steps:
            result = self._fail_row(result, batch.steps[0].row)
            self.fail_next_row = False
        sampled = [s for s in batch.steps if s.sample]
        by_row = {s.row: i for i, s in enumerate(sampled)}
        for req, step in self.core.inflight.get(batch.batch_id, []):
            if self.runner.keep_logits and step.sample and result.error is None and step.row not in result.row_errors:
                self.sample_logits.setdefault(req.rid, []).append(
                    self.runner.last_logits[by_row[step.row]].clone())
        self.core.process_result(result, time.time())
        for out in self.core.take_outputs():
            if out.status == 500 and out.finish_reason:
                self.finish[out.rid] = out.finish_reason  # a row the worker could not compute
            if out.status != 200:
                self.refusals[out.rid] = (out.status, out.error)
                continue
            self.outputs.setdefault(out.rid, []).extend(unpack_ids(out.token_ids).tolist())
            if out.finish_reason:
                self.finish[out.rid] = out.finish_reason
        self.core.check_integrity()
        return True

    @staticmethod
    def _fail_row(result, row: int):
        """The result as if the worker could not compute `row` (BatchResult.row_errors)."""
        rows, tokens = unpack_ids(result.rows).tolist(), unpack_ids(result.tokens).tolist()
        keep = [i for i, r in enumerate(rows) if r != row]
        return msgspec.structs.replace(
            result, rows=pack_ids([rows[i] for i in keep]), tokens=pack_ids([tokens[i] for i in keep]),
            logprobs={r: lp for r, lp in result.logprobs.items() if r != row},
            row_errors={**result.row_errors, row: "injected by the test"})

    def run_until(self, done: Callable[[], bool], max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if done():
                return
            if not self.step() and done():
                return
        raise AssertionError(f"not done after {max_steps} steps")

    def run_to_idle(self, max_steps: int = 10_000) -> None:
        self.run_until(lambda: self.core.idle and not self.queue, max_steps)

    def generate(self, prompt: list[int], max_tokens: int = 8, **params) -> list[int]:
        rid = self.submit(prompt, max_tokens, **params)
        self.run_until(lambda: rid in self.finish)
        return self.outputs[rid]

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()  # the disk writer finishes before the test's directory goes
        self.pool.close()
        self.pool.unlink()


class StubEngine:
    """The real SchedulerCore with a stub worker: no model, so scheduling tests count
    steps and pages in milliseconds. The stub answers every sampling step with token
    `7 + row` (never an EOS: the config has none), or with what `answer` returns."""

    def __init__(self, num_pages: int = 256, page_size: int = 4, max_batch_tokens: int = 64,
                 max_rows: int = 8, max_model_len: int = 512, radix: bool = True, aging_s: float = 5.0,
                 spec_tokens: int = 0, spec_step_tokens: Optional[int] = None):
        self.pool = PagePool.create(num_pages, max_rows, -(-max_model_len // page_size))
        self.core = SchedulerCore(self.pool, SchedulerConfig(
            page_size=page_size, max_batch_tokens=max_batch_tokens, max_model_len=max_model_len,
            vocab_size=1000, radix=radix, aging_s=aging_s, spec_tokens=spec_tokens,
            spec_step_tokens=spec_step_tokens))
        self.queue: deque[ForwardBatch] = deque()
        self.outs: dict[str, list] = {}  # rid -> every RowOut it got
        self._n = 0

    def submit(self, prompt: list[int], max_tokens: int = 4, cache_salt: str = "", age: float = 0.0) -> str:
        rid = f"req-{self._n}"
        self._n += 1
        now = time.time()
        msg = GenerateReq(rid, pack_ids(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                          now - age, cache_salt=cache_salt)
        assert self.core.add_request(msg, now) is None
        return rid

    def request(self, rid: str) -> Optional[Request]:
        return self.core.requests.get(rid)

    def build(self) -> Optional[ForwardBatch]:
        batch = self.core.build_batch(time.time())
        if batch is not None:
            self.queue.append(batch)
        self.core.check_integrity()
        return batch

    def answer(self, batch: ForwardBatch, row_errors: Optional[dict] = None, error: Optional[str] = None):
        from ferroxmp.protocol import BatchResult
        if error is not None:
            return BatchResult(batch.batch_id, error=error)
        row_errors = row_errors or {}
        rows = [s.row for s in batch.steps if s.sample and s.row not in row_errors]
        return BatchResult(batch.batch_id, rows=pack_ids(rows), tokens=pack_ids([7 + r for r in rows]),
                           row_errors=row_errors)

    def report(self, result) -> None:
        """Hand the oldest batch's result to the core (the queue is FIFO, like the worker)."""
        batch = self.queue.popleft()
        assert result.batch_id == batch.batch_id
        self.core.process_result(result, time.time())
        self.collect()
        self.core.check_integrity()

    def collect(self) -> None:
        for out in self.core.take_outputs():
            self.outs.setdefault(out.rid, []).append(out)

    def step(self, overlap: bool = True) -> bool:
        while len(self.queue) < (2 if overlap else 1) and not self.core.lookahead_inflight:
            if self.build() is None:
                break
        if not self.queue:
            return False
        self.report(self.answer(self.queue[0]))
        return True

    def finish_reason(self, rid: str) -> Optional[str]:
        return next((o.finish_reason for o in self.outs.get(rid, []) if o.finish_reason), None)

    def run_to_idle(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.step() and self.core.idle:
                return
        raise AssertionError(f"not idle after {max_steps} steps")

    def close(self) -> None:
        self.pool.close()
        self.pool.unlink()
