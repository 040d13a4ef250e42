"""Decoding rows' K/V kept contiguous from step to step: the CPU decode path without a
per-layer gather.

Job: hold, for exactly the decode rows of the current step, a copy of each row's K/V
positions [0, start] in one tensor per layer, `[slots, kv_heads, cap, head_dim]`, so one
batched SDPA reads every row in place, as the minimal forward does. Gathering each row's
pages from the pool instead costs a copy of the whole context per layer per step (20% of
a batch-16, 2k-context step on this CPU).

How:
- `arrange()` (once per step, before the forward) makes slots [0, b) hold exactly this
  step's b decode rows, in whatever order (it returns each row's slot). Rows not
  decoding this step leave by swap-remove (the last slot moves into the hole: one row's
  copy). A row new to the mirror, or one whose held
  length is not its start (it ran a chunk, was restarted, ...), is filled from the pool:
  one index_select over every layer at once, its only gather.
- `write()` (per layer, in the forward) stores the step's new K/V at each row's start,
  in the pool's bytes: the mirror is a copy of the pool, never a source of truth, so
  attention over it equals attention over the pool to the bit.
- Capacity grows in steps of GROW positions / 8 slots; beyond `budget_bytes` (the KV
  pool's own size) the mirror empties itself and the caller gathers from the pool.

Invariants:
- held[row] == positions the slot holds; `forget(row)` (a NewRow: the slot's request
  changed) and `reset()` (a failed forward) drop rows, so stale K/V are never read.
- Only for models without a sliding window (a window would need per-row masks below
  it; those models gather).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ferroxmp.gpu_worker.kv.pool import zeros

GROW = 64  # positions added per reallocation: a copy of the mirror every 64 steps at most


@dataclass
class DecodeMirror:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    budget_bytes: int
    k: torch.Tensor = field(init=False, repr=False)  # [layers, slots, KVH, cap, D]
    v: torch.Tensor = field(init=False, repr=False)
    rows: list[int] = field(default_factory=list)  # row held in each slot, slot order
    held: dict[int, int] = field(default_factory=dict)  # row -> positions held

    def __post_init__(self) -> None:
        self._empty()

    def _empty(self) -> None:
        # A new tensor, not a zero-size view of the old one: a view would keep its storage.
        self.k = self.v = torch.empty(self.num_layers, 0, self.kv_heads, 0, self.head_dim,
                                      dtype=self.dtype, device=self.device)

    @property
    def cap(self) -> int:
        return self.k.shape[3]

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    def _bytes(self, slots: int, cap: int) -> int:
        return 2 * self.num_layers * slots * self.kv_heads * cap * self.head_dim * self.k.element_size()

    def forget(self, row: int) -> None:
        if row in self.held:
            self._remove(self.rows.index(row))

    def reset(self) -> None:
        self.rows, self.held = [], {}

    def release(self) -> None:
        """Hold nothing and give the memory back (rows are refilled from the pool)."""
        self.reset()
        self._empty()

    def _remove(self, slot: int) -> None:
        gone, last = self.rows[slot], len(self.rows) - 1
        if slot != last:
            n = self.held[self.rows[last]]
            self.k[:, slot, :, :n] = self.k[:, last, :, :n]
            self.v[:, slot, :, :n] = self.v[:, last, :, :n]
            self.rows[slot] = self.rows[last]
        self.rows.pop()
        del self.held[gone]

    def _grow(self, slots: int, cap: int) -> None:
        # Zeros: positions past a row's length are masked, and a masked NaN would still
        # poison the softmax (0 * NaN). Lazy on CPU (kv.pool.zeros): slots and positions
        # no row has reached cost no resident memory.
        shape = (self.num_layers, slots, self.kv_heads, cap, self.head_dim)
        k, v = zeros(shape, self.dtype, self.device), zeros(shape, self.dtype, self.device)
        n, c = len(self.rows), min(self.cap, cap)  # a smaller cap still holds every kept row
        if n:
            k[:, :n, :, :c] = self.k[:, :n, :, :c]
            v[:, :n, :, :c] = self.v[:, :n, :, :c]
        self.k, self.v = k, v

    def arrange(self, rows: np.ndarray, starts: np.ndarray,
                fill: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]) -> Optional[np.ndarray]:
        """Hold exactly `rows` (this step's decode rows), each with positions [0, start)
        ready; `fill(row, start)` -> its K, V from the pool `[layers, KVH, start, D]`.
        Returns the slot of each row, or None when that would pass the budget (emptied)."""
        want = dict(zip(rows.tolist(), starts.tolist()))
        for slot in range(len(self.rows) - 1, -1, -1):  # backwards: swap-remove keeps lower slots
            r = self.rows[slot]
            if want.get(r) != self.held[r]:
                self._remove(slot)
        need_slots, need_cap = len(want), int(starts.max()) + 1
        if need_slots > self.slots or need_cap > self.cap:
            slots = max(self.slots, -(-need_slots // 8) * 8)
            if self._bytes(slots, need_cap) > self.budget_bytes:  # no slot to spare
                slots = max(self.slots, need_slots)
            # Room to grow by GROW positions, as far as the budget goes (growing by one
            # position a step would copy the whole mirror every step).
            cap = min(max(self.cap, -(-need_cap // GROW) * GROW), self.budget_bytes // self._bytes(slots, 1))
            if cap < need_cap:
                self.release()
                return None
            self._grow(slots, cap)
        for r, start in want.items():
            if r not in self.held:
                slot = len(self.rows)
                k, v = fill(r, start)
                self.k[:, slot, :, :start] = k
                self.v[:, slot, :, :start] = v
                self.rows.append(r)
            self.held[r] = want[r] + 1  # the forward writes position `start` in every layer
        slot_of = {r: s for s, r in enumerate(self.rows)}
        return np.array([slot_of[r] for r in rows.tolist()], dtype=np.int64)

    def write(self, layer: int, slots: torch.Tensor, starts: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [b, KVH, D]: row i's new K/V at position starts[i] of slot slots[i]."""
        self.k[layer][slots, :, starts] = k
        self.v[layer][slots, :, starts] = v

    def check_integrity(self) -> None:
        assert sorted(self.held) == sorted(self.rows) and len(self.rows) <= self.slots
        assert all(0 < n <= self.cap for n in self.held.values())
