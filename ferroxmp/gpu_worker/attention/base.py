"""The attention interface the model calls, the per-step row plan every backend starts
from, and the float64 reference that checks every backend.

This module is the bottom of the attention code: the backends (attn_*.py) and the
factory (attention.py) import it, and it imports none of them, so there is no
import cycle between the factory and its backends.

Job: turn a step's rows `(row, start, length)` and their page-table rows into one
backend-independent `StepPlan` (host arrays), and define `AttentionBackend`: `plan()`
once per step, then `forward(layer, q, k, v)` per layer. Backends: `attention.cpu` (torch
SDPA), `attention.triton_backend` (our paged kernels), `attention.flashinfer_backend` (CUDA, when installed);
`attention.make_backend` picks one per device.

Invariants:
- Position p of a row lives in slot page_table[row, p // page_size] * page_size +
  p % page_size. The plan reads the page table once per step; layers reuse it.
- A query at position q sees key positions k with k <= q and, with a window W,
  k > q - W (transformers' `sliding_window_overlay`). A row's read pages start at the
  first page holding a visible position; pages below it are never read, so the
  scheduler may have set them to -1.
- Internal token order: every length-1 step first (the decode group), then each longer
  chunk. `order` maps internal order back to the steps; q/k/v arrive in internal order.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Optional

import numpy as np
import torch


class PlanError(ValueError):
    """A step names a page that is missing (-1) or out of range, or runs past the table."""


@dataclass
class StepPlan:
    """One step's rows in internal order (decode rows first), as host arrays."""
    order: list[int]  # step indices in internal order
    rows: np.ndarray  # [R] row slot of each internal row
    starts: np.ndarray  # [R] first new position
    lengths: np.ndarray  # [R] new tokens
    first_page: np.ndarray  # [R] index (in the row's page list) of the first page read
    kv_indptr: np.ndarray  # [R + 1] CSR offsets into kv_pages
    kv_pages: np.ndarray  # pages read by each row, from first_page to its last position's page
    n_decode: int
    page_size: int
    window: Optional[int]

    @property
    def decode_only(self) -> bool:
        """Every row decodes one token (no chunk)."""
        return self.n_decode == len(self.rows)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def q_indptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    @property
    def kv_start(self) -> np.ndarray:
        """Position held by the first slot each row reads."""
        return self.first_page * self.page_size

    @property
    def kv_lens(self) -> np.ndarray:
        """Positions each row's read span covers up to its last new token (inclusive)."""
        return self.starts + self.lengths - self.kv_start

    @cached_property
    def positions(self) -> np.ndarray:
        if self.decode_only:  # a row's one position: its start
            return self.starts.astype(np.int64)
        return np.concatenate([np.arange(s, s + n) for s, n in zip(self.starts, self.lengths)]).astype(np.int64)

    @cached_property
    def write_slots(self) -> np.ndarray:
        if self.decode_only:  # a row's one token, in the row's last page read
            return self.kv_pages[self.kv_indptr[1:] - 1] * self.page_size + self.starts % self.page_size
        pos = self.positions
        row_of = np.repeat(np.arange(len(self.rows)), self.lengths)
        page_idx = pos // self.page_size - self.first_page[row_of] + self.kv_indptr[row_of]
        return self.kv_pages[page_idx] * self.page_size + pos % self.page_size

    @cached_property
    def last_index(self) -> list[int]:
        """Per step (step order): internal index of its last token. (In Python: a step's
        few rows take numpy's cumsum longer than the loop, its code cold after the
        weights' stream: ~80 us of a one-row step.)"""
        ends = list(accumulate(self.lengths.tolist()))
        out = [0] * len(self.order)
        for internal, step in enumerate(self.order):
            out[step] = ends[internal] - 1
        return out

    def check_integrity(self) -> None:
        R = len(self.rows)
        assert sorted(self.order) == list(range(R)), "every step appears once"
        assert (self.lengths[:self.n_decode] == 1).all() and (self.lengths[self.n_decode:] > 1).all()
        assert len(self.kv_indptr) == R + 1 and self.kv_indptr[-1] == len(self.kv_pages)
        n = np.diff(self.kv_indptr)
        assert (n == (self.starts + self.lengths - 1) // self.page_size - self.first_page + 1).all()
        assert (self.kv_lens > 0).all() and (self.kv_lens <= n * self.page_size).all()
        ws = self.write_slots
        assert len(np.unique(ws)) == len(ws), "two tokens of one step write the same slot"


def _plan_decode(steps: list[tuple[int, int, int]], page_table: np.ndarray, page_size: int,
                 num_pages: int) -> Optional[StepPlan]:
    """plan_step for a step of one token a row and no window, in a third of its numpy
    calls (each ~5-10 us in a one-row step, its code cold after the weights' stream:
    docs/BENCHMARKS.md 30). None when a page is out of range: plan_step then says why."""
    rows, starts = [s[0] for s in steps], [s[1] for s in steps]
    count = [p // page_size + 1 for p in starts]  # pages 0 .. the one holding the new token
    if max(count) > page_table.shape[1]:
        return None
    if len(steps) == 1:
        pages = page_table[rows[0], :count[0]].astype(np.int64)
    else:
        pages = np.concatenate([page_table[r, :c] for r, c in zip(rows, count)]).astype(np.int64)
    if pages.min() < 0 or pages.max() >= num_pages:
        return None
    R = len(steps)
    return StepPlan(order=list(range(R)), rows=np.array(rows, np.int64), starts=np.array(starts, np.int64),
                    lengths=np.ones(R, np.int64), first_page=np.zeros(R, np.int64),
                    kv_indptr=np.array(list(accumulate(count, initial=0)), np.int64), kv_pages=pages,
                    n_decode=R, page_size=page_size, window=None)


def plan_step(steps: list[tuple[int, int, int]], page_table: np.ndarray, page_size: int,
              num_pages: int, window: Optional[int]) -> StepPlan:
    """steps = [(row, start, length)] in step order. Raises PlanError on a bad page."""
    if window is None and steps and all(s[2] == 1 for s in steps):
        plan = _plan_decode(steps, page_table, page_size, num_pages)
        if plan is not None:
            return plan
    order = [i for i, s in enumerate(steps) if s[2] == 1] + [i for i, s in enumerate(steps) if s[2] > 1]
    arr = np.array([steps[i] for i in order], dtype=np.int64).reshape(-1, 3)
    rows, starts, lengths = arr[:, 0], arr[:, 1], arr[:, 2]
    first = np.zeros_like(starts) if window is None else np.maximum(0, starts - window + 1) // page_size
    count = (starts + lengths - 1) // page_size - first + 1
    indptr = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
    row_of = np.repeat(np.arange(len(rows)), count)
    col = first[row_of] + np.arange(int(indptr[-1])) - indptr[row_of]
    if len(col) and (col >= page_table.shape[1]).any():
        i = int(np.argmax(col >= page_table.shape[1]))
        raise PlanError(f"row {int(rows[row_of[i]])}: needs page index {int(col[i])}, beyond the "
                        f"page table's {page_table.shape[1]} pages per row")
    pages = page_table[rows[row_of], col].astype(np.int64)
    bad = (pages < 0) | (pages >= num_pages)
    if bad.any():
        i = int(np.argmax(bad))
        raise PlanError(f"row {int(rows[row_of[i]])}: page index {int(col[i])} holds page {int(pages[i])}, "
                        f"not a page of this pool (0..{num_pages - 1})")
    return StepPlan(order=order, rows=rows, starts=starts, lengths=lengths, first_page=first,
                    kv_indptr=indptr, kv_pages=pages, n_decode=int((lengths == 1).sum()),
                    page_size=page_size, window=window)


class AttentionBackend:
    """What the model calls: `plan()` once per step, then `forward()` once per layer.

    `forward` writes the step's new K/V into the pool (layer `layer`) and returns the
    attention of every query over its row's visible positions: q [T, H, D], k/v
    [T, KVH, D] in internal order -> [T, H, D]."""
    name = "abstract"
    mirror = None  # the decode mirror (decode_mirror.py), for a backend that keeps one

    def __init__(self, kv, window: Optional[int], num_heads: Optional[int] = None):
        self.kv = kv
        self.window = window
        self.num_heads = num_heads  # query heads (FlashInfer plans with them; others read q)
        self.step: Optional[StepPlan] = None
        self.pad_page: Optional[int] = None  # CUDA graphs: a page past the scheduler's pool (cuda_graphs.py)

    def plan(self, steps: list[tuple[int, int, int]], page_table: np.ndarray) -> StepPlan:
        pages = self.kv.num_pages if self.pad_page is None else self.pad_page  # the pad page is never a row's
        self.step = plan_step(steps, page_table, self.kv.page_size, pages, self.window)
        self.prepare(self.step)
        return self.step

    def prepare(self, step: StepPlan) -> None:
        """Backend-specific tensors for this step (device copies, kernel plans)."""
        raise NotImplementedError

    def forget(self, row: int) -> None:
        """The row slot holds a new request (a NewRow): drop anything kept for it between steps."""

    def reset(self) -> None:
        """A forward failed part-way: drop everything kept between steps."""

    def idle(self) -> None:
        """No step for a while: give back memory kept between steps only for speed."""

    def fused_decode_target(self):
        """(pool slots, page offsets [R + 1], pages) when every row of this step decodes
        one token (quant/fused_decode.py can run the step in one call, reading each row's
        pages), else None."""
        return None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def reference_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                        steps: list[tuple[int, int, int]], page_table: np.ndarray, page_size: int,
                        window: Optional[int]) -> torch.Tensor:
    """The oracle: one query at a time, float64, straight from the definition. q is in
    STEP order (not internal order); k_slots/v_slots are [slots, KVH, D] and must already
    hold the steps' K/V."""
    heads, kv_heads = q.shape[1], k_slots.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    t = 0
    for row, start, length in steps:
        for i in range(length):
            p = start + i
            seen = [k for k in range(p + 1) if window is None or k > p - window]
            slots = [int(page_table[row, k // page_size]) * page_size + k % page_size for k in seen]
            for h in range(heads):
                kh = k_slots[slots, h // (heads // kv_heads)].double()
                vh = v_slots[slots, h // (heads // kv_heads)].double()
                w = torch.softmax(kh @ q[t, h].double() / q.shape[2] ** 0.5, dim=0)
                out[t, h] = w @ vh
            t += 1
    return out
