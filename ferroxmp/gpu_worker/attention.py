"""Paged attention: the step plan (index tensors built once per step) and the attention
over the KV pool, plus a plain reference implementation kept as the oracle.

Job: for every step of a batch, write its new K/V into the row's pages and attend each
new query over the row's positions, causally, and within the sliding window if any.

Invariants:
- Position p of a row lives in slot page_table[row, p // page_size] * page_size +
  p % page_size. The plan reads the page table once per step; layers reuse its tensors.
- A query at position q sees key positions k with k <= q and, with a window W,
  k > q - W (transformers' `sliding_window_overlay`). Pages that hold no visible position
  are never read, so the scheduler may have set them to -1.
- Reads gather whole pages (one index per page); the mask hides every position of a
  read page that the query must not see (beyond it, before the window, padding).
- Internal token order: every length-1 step first (the decode group: one gathered,
  padded, masked attention call for all of them), then each longer chunk (one call each).
  `order` maps internal order back to the steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F


class PlanError(ValueError):
    """A step names a page that is missing (-1) or out of range, or runs past the table."""


@dataclass
class ChunkPlan:
    begin: int  # token range in internal order
    end: int
    read_pages: torch.Tensor  # [n_pages] the pages holding positions this chunk sees
    mask: torch.Tensor  # [1, 1, len, n_pages * page_size] bool, True = attend


@dataclass
class StepPlan:
    order: list[int]  # step indices in internal order
    positions: torch.Tensor  # [T] int64, internal order
    write_slots: torch.Tensor  # [T] int64
    n_decode: int
    dec_read_pages: Optional[torch.Tensor]  # [B, P] int64 (padding reads page 0, masked)
    dec_mask: Optional[torch.Tensor]  # [B, 1, 1, P * page_size] bool
    chunks: list[ChunkPlan]
    last_index: list[int]  # per step (step order): internal index of its last token

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def check_integrity(self) -> None:
        T = self.num_tokens
        assert self.write_slots.shape == (T,), "one write slot per token"
        assert len(set(self.write_slots.tolist())) == T, "two tokens of one step write the same slot"
        assert sorted(self.last_index) == sorted(set(self.last_index)) and max(self.last_index) < T
        assert self.n_decode + sum(c.end - c.begin for c in self.chunks) == T
        if self.n_decode:
            assert self.dec_mask.any(dim=-1).all(), "a decode row sees nothing"


def first_visible(start: int, window: Optional[int]) -> int:
    """Lowest key position a query at `start` (and so any later one) can see."""
    return 0 if window is None else max(0, start - window + 1)


def _pages(table: np.ndarray, rows: np.ndarray, first: np.ndarray, count: np.ndarray,
           num_pages: int) -> np.ndarray:
    """[len(rows), max(count)] page ids table[row, first + j] for j < count (0 beyond)."""
    cols = np.arange(int(count.max()))[None, :]
    valid = cols < count[:, None]
    idx = np.where(valid, first[:, None] + cols, 0)
    if (idx >= table.shape[1]).any():
        i = int(np.argwhere(idx >= table.shape[1])[0][0])
        raise PlanError(f"row {int(rows[i])}: needs page index {int(idx[i].max())}, beyond the "
                        f"page table's {table.shape[1]} pages per row")
    pages = table[rows[:, None], idx].astype(np.int64)
    bad = valid & ((pages < 0) | (pages >= num_pages))
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise PlanError(f"row {int(rows[i])}: page index {int(idx[i, j])} holds page {int(pages[i, j])}, "
                        f"not a page of this pool (0..{num_pages - 1})")
    return np.where(valid, pages, 0)


def build_plan(steps: list[tuple[int, int, int]], page_table: np.ndarray, page_size: int,
               num_pages: int, window: Optional[int], device: torch.device) -> StepPlan:
    """steps = [(row, start, length)] in step order. Raises PlanError on a bad page.

    Reads are whole pages (one index per page, not per token: far cheaper to gather);
    the mask hides the positions of a read page that a query must not see."""
    dec = [i for i, s in enumerate(steps) if s[2] == 1]
    pre = [i for i, s in enumerate(steps) if s[2] > 1]
    last_index = [0] * len(steps)
    positions, writes = [], []

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    def visible(pos: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
        ok = pos <= q_pos
        return ok & (pos > q_pos - window) if window is not None else ok

    dec_read_pages = dec_mask = None
    if dec:  # vectorised over rows: one table lookup for the whole decode group
        rows = np.array([steps[i][0] for i in dec], dtype=np.int64)
        starts = np.array([steps[i][1] for i in dec], dtype=np.int64)
        lo = np.zeros_like(starts) if window is None else np.maximum(0, starts - window + 1)
        first = lo // page_size
        pages = _pages(page_table, rows, first, starts // page_size - first + 1, num_pages)
        writes.append(pages[np.arange(len(dec)), starts // page_size - first] * page_size + starts % page_size)
        positions.append(starts)
        pos = first[:, None] * page_size + np.arange(pages.shape[1] * page_size)[None, :]
        dec_read_pages = to_dev(pages)
        dec_mask = to_dev(visible(pos, starts[:, None])).view(len(dec), 1, 1, -1)
        for t, i in enumerate(dec):
            last_index[i] = t
    chunks, t = [], len(dec)
    for i in pre:
        row, start, length = steps[i]
        first = first_visible(start, window) // page_size
        count = (start + length - 1) // page_size - first + 1
        pages = _pages(page_table, np.array([row]), np.array([first]), np.array([count]), num_pages)[0]
        q_pos = np.arange(start, start + length, dtype=np.int64)
        writes.append(pages[q_pos // page_size - first] * page_size + q_pos % page_size)
        positions.append(q_pos)
        pos = first * page_size + np.arange(count * page_size)[None, :]
        chunks.append(ChunkPlan(t, t + length, to_dev(pages), to_dev(visible(pos, q_pos[:, None]))[None, None]))
        last_index[i] = t + length - 1
        t += length
    return StepPlan(order=dec + pre, positions=to_dev(np.concatenate(positions)),
                    write_slots=to_dev(np.concatenate(writes)), n_decode=len(dec),
                    dec_read_pages=dec_read_pages, dec_mask=dec_mask, chunks=chunks, last_index=last_index)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_slots: torch.Tensor,
                    v_slots: torch.Tensor, plan: StepPlan, page_size: int) -> torch.Tensor:
    """q [T, H, D], k_new/v_new [T, KVH, D]; k_slots/v_slots [slots, KVH, D] (one layer of
    the pool, written in place). Returns [T, H, D]."""
    k_slots.index_copy_(0, plan.write_slots, k_new)
    v_slots.index_copy_(0, plan.write_slots, v_new)
    heads, kv_heads, dim = q.shape[1], k_new.shape[1], q.shape[2]
    k_pages = k_slots.view(-1, page_size, kv_heads, dim)
    v_pages = v_slots.view(-1, page_size, kv_heads, dim)
    outs = []
    if plan.n_decode:
        b, n = plan.dec_read_pages.shape
        flat = plan.dec_read_pages.view(-1)
        kd = k_pages.index_select(0, flat).view(b, n * page_size, kv_heads, dim).transpose(1, 2)
        vd = v_pages.index_select(0, flat).view(b, n * page_size, kv_heads, dim).transpose(1, 2)
        # GQA without copying K/V: the G query heads sharing a KV head become G queries.
        qd = q[:b].view(b, kv_heads, heads // kv_heads, dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.dec_mask)
        outs.append(od.reshape(b, heads, dim))
    for c in plan.chunks:
        n = c.read_pages.shape[0]
        kc = k_pages.index_select(0, c.read_pages).view(1, n * page_size, kv_heads, dim).transpose(1, 2)
        vc = v_pages.index_select(0, c.read_pages).view(1, n * page_size, kv_heads, dim).transpose(1, 2)
        qc = q[c.begin:c.end].transpose(0, 1).unsqueeze(0)  # [1, H, len, D]
        oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, enable_gqa=heads != kv_heads)
        outs.append(oc[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def reference_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                        steps: list[tuple[int, int, int]], page_table: np.ndarray, page_size: int,
                        window: Optional[int]) -> torch.Tensor:
    """The oracle: one query at a time, float64, straight from the definition. q is in
    STEP order (not internal order); the pool must already hold the steps' K/V."""
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
