"""ModelRunner: execute one ForwardBatch (all its steps in one forward pass) and sample.

Job: keep each row's known tokens, sampling parameters and seed; turn a batch's steps
into one flat forward over the paged KV pool; sample the rows that ask; report.

Invariants:
- A row's tokens (one int32 buffer grown in place, token_ids.TokenIds) are prompt (+
  tokens generated before a retraction) + every token this worker sampled for it; a step feeds tokens[start:start+length], so a decode step
  (start = len - 1, length 1) feeds the last sampled token without the scheduler sending it.
- A batch is validated whole before anything changes: a bad batch (unknown row, a start
  past the known tokens, a sampling step that does not end at the last known token, a
  page -1 or out of range where it must be read or written, a duplicate row) gets
  `BatchResult(error=...)` and leaves every row as it was. The runner never raises.
- Row state is committed only after the forward pass and sampling succeeded. A
  forward or a row that fails anyway fails only its rows (`isolation.py`): they are
  reported in `row_errors`, and the worker stays in step with the scheduler.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from ferroxmp.protocol import (BatchResult, ForwardBatch, NewRow, ProtocolError, RowStep, SamplingParams, pack_ids,
                        unpack_ids)
from ferroxmp.page_pool import PagePool
from ferroxmp.token_ids import TokenIds
from ferroxmp.gpu_worker.attention import PlanError, backend_layout, make_backend, plan_step
from ferroxmp.gpu_worker.sampling.draft_model import DraftModel
from ferroxmp.gpu_worker.sampling.ngram import Backoff, propose
from ferroxmp.gpu_worker.isolation import fail_batch, skip_failed
from ferroxmp.gpu_worker.kv.pool import KVPool, check_cache_dtype
from ferroxmp.gpu_worker.loader import ModelConfig, load_config, load_weights, resolve_device
from ferroxmp.gpu_worker.models import build_model
from ferroxmp.gpu_worker.pooling import MODES as POOLING_MODES, Pooled, normed
from ferroxmp.gpu_worker.quant import describe_bytes, resolve_mode
from ferroxmp.gpu_worker.quant.native import available as native_available
from ferroxmp.gpu_worker.quant.fused_decode import FUSED_ROWS, FusedDecode
from ferroxmp.gpu_worker.quant.glue import RowGlue
from ferroxmp.heap import release_freed_memory
from ferroxmp.gpu_worker.sampling.sampler import RowSample, logprobs_of, sample, sample_rows

if TYPE_CHECKING:  # llguidance (grammar.py) loads on the first constrained request
    from ferroxmp.gpu_worker.sampling.grammar import GrammarCache, RowGrammar
log = logging.getLogger("ferroxmp.worker")


class BatchError(ValueError):
    """The scheduler sent a batch that cannot be computed as asked."""


@dataclass
class RowState:
    tokens: TokenIds
    prompt_len: int  # tokens known when the row was (re)started
    params: SamplingParams
    seed: int
    grammar: Optional["RowGrammar"] = None  # its matcher, when the request asked for structured output
    pooled: Optional[Pooled] = None  # an embedding row's pooling so far (pooling.py)
    grammar_on: bool = True  # false while a reasoning row thinks (params.grammar_after not yet generated)
    backoff: Backoff = field(default_factory=Backoff)  # speculation: when to stop drafting (ngram.py)


def _end_of(generated: list[int], mark: list[int]) -> "Optional[int]":
    """The index just past the first occurrence of `mark` in `generated`, or None."""
    n = len(mark)
    for i in range(len(generated) - n + 1):
        if generated[i:i + n] == mark:
            return i + n
    return None


class ModelRunner:
    def __init__(self, model_path: str, pool: PagePool, page_size: int, device: str = "auto",
                 dtype: str = "auto", attention: str = "auto", tp=None, deterministic: bool = False,
                 cuda_graph: bool = True, keep_logits: bool = False, quantization: str = "auto",
                 draft_model: Optional[str] = None, draft_quantization: str = "auto",
                 fused_decode: bool = True, kv_cache_dtype: str = "auto", decode_steps: int = 1):
        self.device = resolve_device(device)
        self.config: ModelConfig = load_config(model_path, dtype, kv_cache_dtype)
        check_cache_dtype(self.config, self.device, deterministic)
        # --quantization: 'none', 'fp16', 'int8' or 'int4' for this checkpoint and device (quant/policy.py)
        self.quantization = resolve_mode(quantization, model_path, self.device, deterministic)
        self.tp = tp  # --tp > 1: a tp_step.Leader, which tells the other ranks each step
        # float32 on CPU where the native kernels load: the native RMSNorm/RoPE/SiLU-mul (not
        # --deterministic) and, on one rank, every weight in groups.c's panels (PackedF32: any
        # row count, each row's bits independent of the others', quant/packed.py)
        native_f32 = fused_decode and self.device.type == "cpu" and self.config.dtype == torch.float32 \
            and native_available() is None
        if tp is None:
            weights = load_weights(model_path, self.device, self.config.dtype, quantization=self.quantization)
            self.model = build_model(self.config, weights, self.device, f32_panels=native_f32)
            shape = self.config
        else:  # this rank's shard (parallel/group.py): its heads, its slice of the MLP and vocabulary
            self.model, shape = tp.build_model(model_path, self.config, self.device, self.quantization)
        if deterministic:  # --deterministic: batch-invariant matmuls and attention (batch_invariant.py)
            if self.device.type != "cpu":
                raise RuntimeError("--deterministic is measured and tested on CPU only; on CUDA the "
                                   "batch invariance of cuBLAS and of the attention kernels is unverified")
            from ferroxmp.gpu_worker.batch_invariant import make_deterministic
            make_deterministic(self.model)
            attention = "det"
        elif native_f32:
            self.model.glue = RowGlue(self.model.cos_table, self.model.sin_table)  # native RMSNorm/RoPE/SiLU-mul
        self.page_size = page_size
        self._shape, self._attention = shape, attention
        # --draft-model: its own weights, KV (in this pool's pages) and backend (draft_model.py)
        self.drafter = None if draft_model is None else DraftModel(
            draft_model, self.config, self.device, dtype, draft_quantization, attention)
        # CUDA graphs (decode steps replayed per padded batch size) need one page past the
        # scheduler's for padding rows; never on CPU, under --tp or --deterministic.
        self._graphs_allowed = self.device.type == "cuda" and tp is None and not deterministic
        self._fused_decode = fused_decode  # False: --disable-fused-decode (quant/fused_decode.py)
        self._decode_steps = decode_steps  # --decode-steps (the `decode_steps` property: where they can run)
        self.rows: dict[int, RowState] = {}
        self.failed: dict[int, str] = {}  # row -> why; its steps are skipped until a NewRow restarts it
        self.attach_pool(pool, cuda_graph)
        self.faults = None  # test-only fault injection (faults.py), set by the worker process
        self.keep_logits = keep_logits  # debug/tests: keep each step's logits for `last_logits`
        self._logits: Optional[torch.Tensor] = None  # the last step's, left on the device
        self.model_path = model_path
        self._grammars: Optional["GrammarCache"] = None  # built on the first constrained row

    def attach_pool(self, pool: PagePool, cuda_graph: bool = True) -> "ModelRunner":
        """Allocate the KV pool (and the backend and CUDA graphs over it) for `pool`'s pages,
        dropping any earlier one: the worker sizes the real pool on CUDA after profiling a
        step over a small one (gpu_memory.py). Every row is forgotten."""
        self.kv = self.attn = self.graphs = None  # free the old pool before allocating the new
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.pool = pool
        self._table = np.empty_like(pool.page_table)  # execute's snapshot of the stepped rows
        self.rows.clear()
        self.failed = {}
        graphs = cuda_graph and self._graphs_allowed
        layout = backend_layout(self.device, self._attention)
        if self.drafter is not None:
            self.drafter.attach(pool.num_pages, self.page_size, layout)
        self.kv = KVPool.for_model(self._shape, pool.num_pages + graphs, self.page_size, self.device, layout=layout)
        self.attn = make_backend(self.kv, self.config.sliding_window, self.device, self._attention,
                                 num_heads=self._shape.num_heads, dtype=self.config.dtype,
                                 native_decode=self._fused_decode and self.tp is None)
        self.graphs = self._decode_graphs(pool) if graphs else None
        if not self._fused_decode:
            self.model.fused_decode, why = None, "--disable-fused-decode"
        elif self.tp is not None:
            self.model.fused_decode, why = None, "--tp"  # each rank holds a shard: the all-reduce is torch's
        else:
            self.model.fused_decode, why = FusedDecode.build(self.model, self.kv, self.attn)
        if self.device.type == "cpu":
            log.info("decode steps of 1-%d rows: %s", FUSED_ROWS,
                     "fused (one native call)" if why is None else f"eager ({why})")
        log.info("memory: %s", describe_bytes(self.model.weight_bytes(), self.kv.nbytes, self._shape.cache_dtype_name))
        return self

    @property
    def spec_step_tokens(self) -> Optional[int]:
        """Most tokens (decode rows and their drafts) a step should verify, for the
        scheduler's draft budget: on CPU the matmul kernels take up to FUSED_ROWS rows in
        one pass over each weight, a step of few rows costing mostly its weight reads (a
        5-token int4 verify ~2.2x one token, docs/BENCHMARKS.md 25); past that a token's
        compute is what a step costs and a draft pays only when accepted. None on CUDA
        (not measured there)."""
        return FUSED_ROWS if self.device.type == "cpu" else None

    @property
    def decode_steps(self) -> int:
        """Most greedy decode steps a batch runs in one call: --decode-steps where the fused
        step computes its head and looks its tokens up itself (CPU), else 1. The worker tells
        the scheduler, which gives no budget (and keeps the overlap) where this is 1."""
        f = self.model.fused_decode
        return self._decode_steps if f is not None and f.has_head and f.embeds and self.graphs is None else 1

    def idle(self) -> None:
        """The worker had no batch for a poll interval: the backends give back what they
        keep between steps only for speed (the CPU decode mirror), and the heap's freed
        pages go back to the OS: a load's activations (tens of MB a prefill step) are freed
        into glibc's heap, which keeps them resident otherwise (~40 MB after a 16-user
        load of SmolLM2, docs/BENCHMARKS.md 23)."""
        self.attn.idle()
        if self.drafter is not None:
            self.drafter.idle()
        if self.device.type == "cpu":
            release_freed_memory()

    def memory_info(self) -> dict:
        """Resident weight bytes by format and the KV pool's bytes (this rank's), for /server_info."""
        weights = self.model.weight_bytes()
        info = {"quantization": self.quantization, "weight_bytes": sum(weights.values()),
                "weight_bytes_by_format": weights, "kv_bytes": self.kv.nbytes,
                "kv_dtype": self._shape.cache_dtype_name, "kv_tokens": self.kv.num_slots}
        if self.model.weight_arena is not None:  # CPU: how much of the weights the kernel backs with 2 MiB pages
            info["weight_huge_page_bytes"] = self.model.weight_arena.huge_bytes()
        if self.drafter is not None:
            info["draft"] = self.drafter.memory_info()
        return info

    @property
    def kv_bytes(self) -> int:
        """KV bytes this runner holds: the target's pool, and the draft model's beside it."""
        return self.kv.nbytes + (self.drafter.kv.nbytes if self.drafter is not None else 0)

    def _forget(self, row: int) -> None:
        """The row slot holds a new request: the backends drop what they kept for it."""
        self.attn.forget(row)
        if self.drafter is not None:
            self.drafter.forget(row)

    def profile_step(self, lengths: list[int]) -> None:
        """One prefill step of len(lengths) rows, each sampling (the largest step the
        scheduler may send: --max-batch-tokens over up to --max-running-requests rows), on
        consecutive pages of the pool, through a page table of its own: the pool's table
        has one writer, the scheduler. The rows are forgotten after."""
        pages = [-(-n // self.page_size) for n in lengths]
        if sum(pages) > self.pool.num_pages or max(pages) > self.pool.max_pages_per_row:
            raise ValueError(f"profiling rows of {lengths[:4]}... tokens needs {sum(pages)} pages, up to "
                             f"{max(pages)} a row; the pool has {self.pool.num_pages}, "
                             f"{self.pool.max_pages_per_row} a row")
        first = np.cumsum([0] + pages)
        table = np.full(self.pool.page_table.shape, -1, np.int32)
        for row, k in enumerate(pages):
            table[row, :k] = np.arange(first[row], first[row] + k)
        ids = np.random.default_rng(0).integers(0, self.config.vocab_size, sum(lengths), dtype=np.int32)
        cuts = np.cumsum([0] + lengths)
        params = SamplingParams(max_tokens=1)
        batch = ForwardBatch(batch_id=-1, steps=[RowStep(r, 0, n, True) for r, n in enumerate(lengths)],
                             new_rows=[NewRow(r, pack_ids(ids[cuts[r]:cuts[r + 1]]), params)
                                       for r in range(len(lengths))])
        try:
            result = self.execute(batch, table)
            if result.error or result.row_errors:
                raise RuntimeError(f"the profiling step failed: {result.error or result.row_errors}")
        finally:
            for row in range(len(lengths)):
                self.rows.pop(row, None)
                self._forget(row)

    @property
    def grammars(self) -> "GrammarCache":
        if self._grammars is None:
            from ferroxmp.gpu_worker.sampling.grammar import GrammarCache
            self._grammars = GrammarCache.for_checkpoint(self.model_path, self.config.vocab_size,
                                                         self.config.eos_token_ids)
        return self._grammars

    @property
    def last_logits(self) -> torch.Tensor:
        """Raw logits [sampled rows, vocab] of the last step, copied to the host only when
        asked; kept only by a runner built with keep_logits=True (tests, debugging)."""
        if not self.keep_logits:
            raise RuntimeError("last_logits needs a ModelRunner built with keep_logits=True")
        if self._logits is None:
            return torch.empty(0, self.config.vocab_size)
        return self._logits.float().cpu()

    def _decode_graphs(self, pool: PagePool):
        """CUDA graphs for decode-only steps (cuda_graphs.py), where the backend supports them."""
        if not hasattr(self.attn, "enable_padding"):
            log.info("CUDA graphs off: the %s attention backend has no padded decode path", self.attn.name)
            return None
        from ferroxmp.gpu_worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
        sizes = graph_batch_sizes(pool.max_rows)
        self.attn.enable_padding(sizes[-1], sizes[-1] * pool.max_pages_per_row, pad_page=pool.num_pages)
        return DecodeGraphs(self.model, self.attn, sizes, self.device)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor; on CUDA through pinned memory, without a sync."""
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)

    def row_tokens(self, row: int) -> list[int]:
        return self.rows[row].tokens.array.tolist()

    def _stage_rows(self, batch: ForwardBatch) -> dict[int, RowState]:
        staged: dict[int, RowState] = {}
        for nr in batch.new_rows:
            if not 0 <= nr.row < self.pool.max_rows:
                raise BatchError(f"new row {nr.row} is not a row slot (0..{self.pool.max_rows - 1})")
            if nr.row in staged:
                raise BatchError(f"row {nr.row} is started twice in one batch")
            ids = TokenIds(unpack_ids(nr.token_ids))  # the row's one copy of its tokens
            if not len(ids):
                raise BatchError(f"new row {nr.row} has no tokens")
            if ids.array.min() < 0 or ids.array.max() >= self.config.vocab_size:
                raise BatchError(f"new row {nr.row} has a token id outside the vocabulary "
                                 f"(0..{self.config.vocab_size - 1})")
            staged[nr.row] = st = RowState(ids, nr.prompt_len or len(ids), nr.params, nr.seed)
            if nr.params.pooling is not None:
                if nr.params.pooling not in POOLING_MODES:
                    raise BatchError(f"new row {nr.row}: pooling {nr.params.pooling!r} is not one of {POOLING_MODES}")
                st.pooled = Pooled(nr.params.pooling)
            if nr.params.grammar is not None:  # a fresh matcher, replaying what it generated
                generated = ids[st.prompt_len:].tolist()
                if nr.params.grammar_after:  # only what follows the end of the thinking
                    end = _end_of(generated, nr.params.grammar_after)
                    st.grammar_on = end is not None
                    generated = generated[end:] if end is not None else []
                try:
                    st.grammar = self.grammars.matcher(nr.params.grammar, generated)
                except ValueError as e:  # GrammarError
                    raise BatchError(f"new row {nr.row}: {e}") from None
        return staged

    def _check_steps(self, steps: list[RowStep], staged: dict[int, RowState]) -> None:
        seen = set()
        limit = self.config.max_position_embeddings
        for s in steps:
            state = staged.get(s.row) or self.rows.get(s.row)
            if state is None:
                raise BatchError(f"step names row {s.row}, which no NewRow started")
            if s.row in seen:
                raise BatchError(f"row {s.row} has two steps in one batch")
            seen.add(s.row)
            end = s.start + s.length
            if s.length < 1 or s.start < 0 or end > len(state.tokens):
                raise BatchError(f"row {s.row}: step [{s.start}, {end}) is outside its "
                                 f"{len(state.tokens)} known tokens")
            if s.sample and end != len(state.tokens):
                raise BatchError(f"row {s.row}: a sampling step must end at its last known token "
                                 f"({len(state.tokens)}), not at {end}")
            if end > limit:
                raise BatchError(f"row {s.row}: position {end - 1} is beyond the model's context ({limit})")

    def execute(self, batch: ForwardBatch, table: Optional[np.ndarray] = None) -> BatchResult:
        """`table`: a page table to read instead of the pool's (profile_step's own)."""
        t0 = time.perf_counter()
        batch, skipped = skip_failed(self.failed, batch)
        try:
            staged = self._stage_rows(batch)
            for row in staged:  # a new request in the slot: nothing kept for the old one applies
                self._forget(row)
            self._check_steps(batch.steps, staged)
            if not batch.steps:
                self.rows.update(staged)
                return BatchResult(batch_id=batch.batch_id, compute_s=time.perf_counter() - t0)
            # Copy only the stepped rows' entries (a snapshot: the scheduler may write other
            # rows meanwhile) into a buffer kept between steps; its other rows, left from
            # earlier steps, are never read. (A fresh table each step, 0.5 MB at 256 rows,
            # was an mmap, a page fault and an munmap: ~50 us of a one-row step.)
            if table is None:
                stepped = sorted({s.row for s in batch.steps})
                table = self._table
                table[stepped] = self.pool.page_table[stepped]
            # The draft model runs on every step (its KV keeps up with the target's). With
            # --decode-steps, batch.spec is the further steps' budget, not a draft's.
            drafts = self._drafts(batch, staged, table) if (batch.spec and self.decode_steps == 1) or self.drafter \
                else {}
            triples = [(s.row, s.start, s.length + len(drafts.get(s.row, ()))) for s in batch.steps]
            plan = self.attn.plan(triples, table)
            steps = self._plan_steps(batch, staged, plan, table) if batch.spec and self.decode_steps > 1 else None
        except (BatchError, PlanError, ProtocolError) as e:
            log.warning("batch %d refused: %s", batch.batch_id, e)
            return BatchResult(batch_id=batch.batch_id, error=str(e))
        try:
            result = self._run_steps(batch, staged, plan, t0, *steps) if steps else \
                self._run(batch, staged, plan, t0, drafts)
        except Exception as e:  # a bug or OOM must not kill the worker: only this batch's rows fail
            if self.tp is not None:
                raise  # ...unless other ranks may be inside a collective this one left: fatal
            log.exception("batch %d failed", batch.batch_id)
            self.attn.reset()  # the backend may hold K/V of a step that stopped part-way
            if self.drafter is not None:
                self.drafter.reset()
            result = fail_batch(self.failed, self.rows, staged, batch,
                                f"worker failed: {type(e).__name__}: {e}", t0)
        result.row_errors.update(skipped)
        return result

    def _drafts(self, batch: ForwardBatch, staged: dict[int, RowState], table: np.ndarray) -> dict[int, list[int]]:
        """row -> the tokens to verify after its sampled one, for the unconstrained sampling
        rows the scheduler gave a draft budget (pages), not backing off: from the draft
        model (--draft-model, which also keeps its KV up with this step) or by prompt
        lookup (--speculative-ngram)."""
        budget = {}
        limit = self.config.max_position_embeddings
        for s in batch.steps:
            k = batch.spec.get(s.row, 0)
            st = staged.get(s.row) or self.rows.get(s.row)
            if k <= 0 or not s.sample or st is None or not st.params.may_draft:
                continue
            k = min(k, limit - (s.start + s.length))
            if k > 0 and st.backoff.wants_draft():
                budget[s.row] = min(k, st.backoff.length)
        if self.drafter is not None:
            tokens = {s.row: (staged.get(s.row) or self.rows[s.row]).tokens for s in batch.steps}
            return self.drafter.propose(batch.steps, tokens, budget, table)
        drafts = {r: propose((staged.get(r) or self.rows[r]).tokens.array, k) for r, k in budget.items()}
        return {r: d for r, d in drafts.items() if d}

    def _plan_steps(self, batch: ForwardBatch, staged: dict[int, RowState], plan,
                      table: np.ndarray) -> Optional[tuple[int, torch.Tensor, torch.Tensor]]:
        """--decode-steps: (n, page_at, pages) where this step and n - 1 more run in one
        native call (FusedDecode.steps), else None (one step, as without the flag). Only a
        step of decode rows that all choose by argmax, with nothing that edits their logits
        or asks for them (SamplingParams.may_draft), where the fused step computes its head;
        n - 1 is the least further positions the scheduler held pages for (batch.spec), and
        pages[page_at[r]:page_at[r + 1]] are row r's up to its last step's position (the
        last step's own plan: its pages checked as any step's are)."""
        f = self.model.fused_decode  # (not None: decode_steps > 1)
        if not plan.decode_only or len(plan.rows) > f.max_rows or self.keep_logits or self.faults is not None:
            return None  # (test hooks: last_logits and fault injection are per step)
        n = self.decode_steps
        for s in batch.steps:
            params = (staged.get(s.row) or self.rows[s.row]).params
            if not (s.sample and params.greedy and params.may_draft):
                return None
            n = min(n, 1 + batch.spec.get(s.row, 0))
        starts = plan.starts.tolist()  # (decode only: step order)
        n = min(n, self.config.max_position_embeddings - max(starts))
        if n < 2:
            return None
        last = plan_step([(r, start + n - 1, 1) for r, start in zip(plan.rows.tolist(), starts)], table,
                         self.page_size, self.pool.num_pages, None)
        return n, torch.from_numpy(last.kv_indptr), torch.from_numpy(last.kv_pages)

    def _run_steps(self, batch: ForwardBatch, staged: dict[int, RowState], plan, t0: float, n: int,
                   page_at: torch.Tensor, pages: torch.Tensor) -> BatchResult:
        """--decode-steps: n greedy steps of this batch's decode rows in one call. Each row's
        first token goes back as its sampled one, the n - 1 after it as accepted tokens
        (spec_tokens; none was drafted): the scheduler takes them up to a stop or max_tokens."""
        state = {**self.rows, **staged}
        rows = plan.rows.tolist()
        ids = torch.tensor([state[s.row].tokens[s.start] for s in batch.steps], dtype=torch.int64)
        top = self.model.fused_decode.steps(ids, torch.from_numpy(plan.starts), page_at, pages, n)
        self._logits = None
        self.rows.update(staged)
        chosen = top.numpy()
        for j, r in enumerate(rows):
            self.rows[r].tokens.extend(chosen[:, j])
        return BatchResult(batch_id=batch.batch_id, rows=pack_ids(rows), tokens=pack_ids(chosen[0]),
                           spec_tokens={r: pack_ids(chosen[1:, j]) for j, r in enumerate(rows)},
                           compute_s=time.perf_counter() - t0)

    def _run(self, batch: ForwardBatch, staged: dict[int, RowState], plan, t0: float,
             drafts: dict[int, list[int]]) -> BatchResult:
        state = {**self.rows, **staged}
        pieces = []  # views of the rows' buffers; one concatenation makes the step's input
        for i in plan.order:
            s = batch.steps[i]
            pieces.append(state[s.row].tokens[s.start:s.start + s.length])
            if drafts and s.row in drafts:
                pieces.append(np.asarray(drafts[s.row], dtype=np.int32))
        ids_np = np.concatenate(pieces).astype(np.int64)
        if self.faults is not None:
            self.faults.before_forward(ids_np)
        sampling = [i for i, s in enumerate(batch.steps) if s.sample]
        # A row with a draft samples at its last known token, before the draft's positions.
        last = [plan.last_index[i] - len(drafts.get(batch.steps[i].row, ())) for i in sampling]
        rows = [batch.steps[i].row for i in sampling]
        # One lm_head call for the sampled positions and the drafts' (the head's weights
        # read once a verify, not twice: ~0.8 ms of an int4 SmolLM2 verify's ~14)
        index = last + [i for at, r in zip(last, rows) for i in range(at + 1, at + 1 + len(drafts.get(r, ())))]
        with torch.inference_mode():
            if self.tp is not None:
                self.tp.send_step(plan, ids_np)
            # Every token samples or verifies a draft: the fused step's call computes their
            # logits too (None: it does not run here, and lm_head runs on `hidden` below).
            step = None
            if self.graphs is not None and self.graphs.fits(plan):
                hidden = self.graphs.forward(plan, ids_np)
            else:
                ids, pos = self._to_device(ids_np), self._to_device(plan.positions)
                step = self.model.forward_logits(ids, pos, self.attn) if len(index) == len(ids_np) else None
                hidden = step[0] if step is not None else self.model.forward(ids, pos, self.attn)
            prompt_lps = self._prompt_logprobs(batch, state, plan, hidden)
            embeddings = self._embeddings(batch, state, plan, hidden)
            if not sampling:
                self._logits = None
                self.rows.update(staged)
                return BatchResult(batch_id=batch.batch_id, compute_s=time.perf_counter() - t0,
                                   prompt_logprobs=prompt_lps)  # no embedding: none ended its prompt
            top = top_after = None  # the fused step's argmax of each token's logits
            if step is None:
                every = self._logits_at(hidden, torch.tensor(index, device=self.device))
            else:  # every token's, in internal order: the index is a permutation (the identity
                # unless several rows verify drafts)
                every, top = step[1:] if index == list(range(len(index))) else (step[1][index], step[2][index])
            logits, after = (every[:len(last)], every[len(last):]) if drafts else (every, None)
            if drafts and top is not None:
                top, top_after = top[:len(last)], top[len(last):]
            want = [state[r] for r in rows]
            chosen, bad = sample_rows(logits, self._row_samples(want), self.faults, top)
            lp_rows = [j for j, st in enumerate(want) if st.params.logprobs is not None and j not in bad]
            lps = logprobs_of(logits[lp_rows], chosen[lp_rows],
                              [want[j].params.logprobs for j in lp_rows]) if lp_rows else []
            spec = self._verify(drafts, after, top_after, rows, chosen, bad, state) if drafts else {}
        self._logits = logits.clone() if self.keep_logits else None  # (the fused step's: a view it reuses)
        self.rows.update(staged)
        row_errors = {rows[j]: why for j, why in bad.items()}
        self.failed.update(row_errors)
        ok = [(r, tok) for j, (r, tok) in enumerate(zip(rows, chosen.tolist())) if j not in bad]
        for r, tok in ok:
            st = self.rows[r]
            st.tokens.append(tok)
            if spec.get(r):  # (extend's numpy calls, ~20 us cold, for nothing otherwise)
                st.tokens.extend(spec[r])
            if st.grammar is not None:
                if st.grammar_on:
                    st.grammar.advance(tok)
                else:  # thinking: the grammar starts after the marker's last token
                    mark = st.params.grammar_after
                    st.grammar_on = st.tokens.ends_with(mark) and len(st.tokens) - st.prompt_len >= len(mark)
        return BatchResult(batch_id=batch.batch_id, rows=pack_ids([r for r, _ in ok]),
                           tokens=pack_ids([t for _, t in ok]),
                           spec_tokens={r: pack_ids(x) for r, x in spec.items() if x},
                           spec_drafted=sum(len(d) for r, d in drafts.items() if r in spec),
                           spec_accepted=sum(len(x) for x in spec.values()),
                           logprobs={rows[j]: lp for j, lp in zip(lp_rows, lps)},
                           compute_s=time.perf_counter() - t0, row_errors=row_errors,
                           prompt_logprobs=prompt_lps,
                           embeddings={r: v for r, v in embeddings.items() if r not in row_errors})

    def _prompt_logprobs(self, batch: ForwardBatch, state: dict[int, RowState], plan,
                         hidden: torch.Tensor) -> dict[int, list]:
        """For rows asking for prompt logprobs: the logprob (and top-n) of each prompt token
        this step's positions predict. Position p's hidden state predicts token p + 1, so a
        step [start, start + length) yields tokens start + 1 .. start + length, cut at the
        prompt's end (the token after it is sampled and gets ordinary logprobs). Only these
        rows' positions go through lm_head; every other row stays at its last position."""
        out: dict[int, list] = {}
        for i, s in enumerate(batch.steps):
            st = state[s.row]
            n = st.params.prompt_logprobs
            stop = min(s.start + s.length + 1, st.prompt_len)
            if n is None or stop <= s.start + 1:
                continue
            first = plan.last_index[i] - s.length + 1  # the step's first token, internal order
            logits = self._logits_at(hidden, slice(first, first + stop - s.start - 1))
            targets = torch.from_numpy(st.tokens[s.start + 1:stop].astype(np.int64)).to(self.device)
            out[s.row] = logprobs_of(logits, targets, [n] * len(targets))
        return out

    def _embeddings(self, batch: ForwardBatch, state: dict[int, RowState], plan,
                    hidden: torch.Tensor) -> dict[int, bytes]:
        """Embedding rows: add each step's positions to the row's pooling; a sampling step
        (the prompt's last chunk) gives the row's vector (pooling.py)."""
        out: dict[int, bytes] = {}
        for i, s in enumerate(batch.steps):
            pooled = state[s.row].pooled
            if pooled is None:
                continue
            last = plan.last_index[i]
            if pooled.mode == "last":
                if s.sample:
                    out[s.row] = pooled.vector(normed(self.model, hidden[last:last + 1])[0])
                continue
            states = normed(self.model, hidden[last - s.length + 1:last + 1])
            pooled.add(states, s.start)
            if s.sample:
                out[s.row] = pooled.vector(states[-1])
        return out

    def _verify(self, drafts, logits: torch.Tensor, top: Optional[torch.Tensor], rows, chosen, bad,
                state) -> dict[int, list[int]]:
        """Verification of the drafts by the row's own sampler: at each draft position the
        token the row would sample there in a step of its own (argmax when greedy; with
        temperature, the Gumbel-max draw, whose noise is a function of (seed, position):
        the same draw). A draft token is accepted while it equals the token sampled before
        it, and the token sampled after the last accepted one is emitted too; so the
        output is the one decoding without drafts gives, greedy or sampled. `logits`: the
        drafts' positions, row after row (top: their argmax, where known). Returns row -> the
        tokens emitted after `chosen`."""
        keep, samples, where, at = [], [], [], 0
        for j, r in enumerate(rows):
            d = drafts.get(r, ())
            if d and j not in bad:
                st = state[r]
                where.append((j, r, d, len(keep)))
                keep.extend(range(at, at + len(d)))
                # chosen[j] is token len(st.tokens); draft position i predicts the one after
                samples.extend(RowSample(st.params, st.seed, len(st.tokens) + 1 + i) for i in range(len(d)))
            at += len(d)
        if not where:
            return {}
        try:
            # every row's drafts, unless a row failed to sample: no gather (a copy) then
            whole = len(keep) == len(logits)
            after = sample(logits if whole else logits[keep], samples,
                           top if whole or top is None else top[keep]).tolist()
        except Exception as e:  # the rows keep their sampled token; the drafts are dropped
            log.warning("verifying drafts failed (%s: %s); dropping them", type(e).__name__, e)
            return {}
        out = {}
        for j, r, d, k in where:
            said = [int(chosen[j])] + after[k:k + len(d)]  # the token sampled after each input
            a = 0
            while a < len(d) and said[a] == d[a]:
                a += 1
            out[r] = said[1:a + 1]
            state[r].backoff.verified(len(d), a)
        return out

    def _logits_at(self, hidden: torch.Tensor, index) -> torch.Tensor:
        """lm_head on some of the step's positions; under --tp the other ranks compute their
        vocabulary shard of the same positions (the gather needs every rank)."""
        if self.tp is not None:
            self.tp.send_logits(index)
        return self.model.logits(hidden[index])

    def _row_samples(self, want: list[RowState]) -> list[RowSample]:
        """What the sampler needs of each row: its grammar's bitmask for this step, and
        the ids min_tokens still blocks (EOS and stop_token_ids)."""
        gram = [j for j, st in enumerate(want) if st.grammar is not None and st.grammar_on]
        bitmask = None
        if gram:
            from ferroxmp.gpu_worker.sampling.grammar import allocate
            bitmask = allocate(len(gram), self.config.vocab_size)
        for k, j in enumerate(gram):
            want[j].grammar.fill(bitmask, k)
        allowed = {j: bitmask[k] for k, j in enumerate(gram)}
        out = []
        for j, st in enumerate(want):
            p = st.params
            blocked = (list(self.config.eos_token_ids) + list(p.stop_token_ids)
                       if len(st.tokens) - st.prompt_len < p.min_tokens else ())
            out.append(RowSample(p, st.seed, len(st.tokens), st.tokens.array if p.has_penalties else None,
                                 st.prompt_len, allowed=allowed.get(j), blocked=blocked))
        return out
