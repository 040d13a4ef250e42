"""The deterministic attention backend (`--deterministic`): a query's output bits depend
only on its own q and the keys it sees, never on the batch, the chunk it came in, or
where that chunk started.

Job: the same `AttentionBackend` interface and "hnd" KV layout as the torch backend
(`attention/cpu.py`), computed so that every reduction runs in an order fixed by absolute
positions:
- Keys are split into blocks of `block` positions at absolute boundaries (block b holds
  positions [b * block, (b + 1) * block)); a row gathers whole blocks, and keys it may
  not see (causal, window, padding, pages it does not own) are masked to -inf.
- Scores q.k are one batched matmul whose reduction (over head_dim) does not depend on
  how many queries or keys the call holds, once the query count is padded to a multiple
  of `Q_TILE` (the CPU gemm's row micro-tile; a query in a tail tile or alone takes
  another kernel with another summation order: measured, see batch_invariant.py).
- Softmax: the max over visible keys is exact in any order; exp(s - max) is
  elementwise; the denominator is summed within each block (a fixed 32-or-more-element
  reduction) and then over blocks in ascending order by a sequential scan (cumsum).
  Masked keys are exact zeros, and x + 0 == x, so blocks a query cannot see (trailing,
  or before its window) change nothing: the same query gets the same bits whether its
  chunk gathered 3 blocks or 30.
- p @ v is one fixed-shape matmul per block ([queries, block] x [block, head_dim]),
  summed over blocks by the same ascending scan.
- Everything is computed in float32 (bf16 K/V are widened), then cast back.
Chunks are processed in tiles of `tile_tokens` queries to bound memory; a tile reads
only the blocks up to its last query. Checked against `attention.reference_attention`
(float64) and bitwise across batch mixes in tests/test_deterministic.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ferroxmp.gpu_worker.attention.base import AttentionBackend, StepPlan

Q_TILE = 4  # query rows per gemm micro-tile on this CPU (fp32 and bf16): pad to a multiple
TILE_TOKENS = 256  # a chunk's queries per tile (bounds the score matrix; tests shrink it)


@dataclass
class _Group:
    """Queries sharing one gather: a tile of a chunk (rows == 1) or every decode row."""
    begin: int  # token range in internal order
    end: int
    rows: int  # rows gathered (decode: one per token; chunk tile: 1)
    n_blocks: int  # key blocks gathered per row
    pages: torch.Tensor  # [rows * blocks * pages_per_block] (page 0 where not owned: masked);
    # the tiles of one chunk share one tensor, gathered once per layer
    key_offset: int  # first key of this group within that gather
    bias: torch.Tensor  # [rows, 1, padded queries, n_blocks * block] float32: 0 visible, -inf hidden
    queries: int  # query rows per KV head before padding (tokens per row x query heads per KV head)


class DeterministicBackend(AttentionBackend):
    name = "det"

    def __init__(self, kv, window: Optional[int], num_heads: Optional[int] = None,
                 tile_tokens: Optional[int] = None):
        if kv.layout != "hnd":
            raise ValueError("the deterministic backend needs the KV pool in the 'hnd' layout")
        super().__init__(kv, window, num_heads)
        self.block = kv.page_size * max(1, 32 // kv.page_size)  # >= 32 keys: a fixed-size inner sum
        self.tile_tokens = tile_tokens or TILE_TOKENS
        self.write_slots: Optional[torch.Tensor] = None
        self.groups: list[_Group] = []

    @property
    def pages_per_block(self) -> int:
        return self.block // self.kv.page_size

    def _pages(self, step: StepPlan, i: int, first_block: int, n_blocks: int) -> np.ndarray:
        """Row i's pages for blocks [first_block, first_block + n_blocks); 0 where the plan
        reads no page (before its window, past its last position): those keys are masked."""
        ppb = self.pages_per_block
        cols = first_block * ppb + np.arange(n_blocks * ppb)
        last = step.first_page[i] + step.kv_indptr[i + 1] - step.kv_indptr[i]
        owned = (cols >= step.first_page[i]) & (cols < last)
        idx = np.where(owned, step.kv_indptr[i] + cols - step.first_page[i], 0)
        return np.where(owned, step.kv_pages[idx], 0)

    def _visible(self, q_pos: np.ndarray, first_block: int, n_blocks: int) -> np.ndarray:
        key = first_block * self.block + np.arange(n_blocks * self.block)[None, :]
        ok = key <= q_pos[:, None]
        return ok & (key > q_pos[:, None] - self.window) if self.window is not None else ok

    def _bias(self, vis: np.ndarray) -> tuple[torch.Tensor, int]:
        """[rows, tokens, keys] visibility -> the additive mask in the gemm's query order
        (each token's G query heads, then padding rows copying the last real one)."""
        G = (self.num_heads or self.kv.num_kv_heads) // self.kv.num_kv_heads
        vis = np.repeat(vis, G, axis=1)
        m = vis.shape[1]
        padded = max(Q_TILE, -(-m // Q_TILE) * Q_TILE)
        vis = np.concatenate([vis, np.repeat(vis[:, -1:], padded - m, axis=1)], axis=1)
        bias = np.where(vis, np.float32(0), np.float32(-np.inf))[:, None]
        return torch.from_numpy(np.ascontiguousarray(bias)).to(self.kv.device), m

    def _first_block(self, start: int) -> int:
        return (0 if self.window is None else max(0, start - self.window + 1)) // self.block

    def prepare(self, step: StepPlan) -> None:
        dev = self.kv.device
        self.write_slots = torch.from_numpy(step.write_slots.astype(np.int64)).to(dev)
        self.groups = []
        b = step.n_decode
        if b:
            fb = [self._first_block(int(s)) for s in step.starts[:b]]
            nb = max(int(s) // self.block - f + 1 for s, f in zip(step.starts[:b], fb))
            pages = np.concatenate([self._pages(step, i, fb[i], nb) for i in range(b)])
            vis = np.stack([self._visible(step.starts[i:i + 1], fb[i], nb) for i in range(b)])
            self.groups.append(_Group(0, b, b, nb, torch.from_numpy(pages).to(dev), 0, *self._bias(vis)))
        t = b
        for i in range(b, len(step.rows)):
            start, length = int(step.starts[i]), int(step.lengths[i])
            row_fb = self._first_block(start)
            row_nb = (start + length - 1) // self.block - row_fb + 1
            pages = torch.from_numpy(self._pages(step, i, row_fb, row_nb)).to(dev)
            for lo in range(start, start + length, self.tile_tokens):
                hi = min(lo + self.tile_tokens, start + length)
                fb = self._first_block(lo)
                nb = (hi - 1) // self.block - fb + 1
                vis = self._visible(np.arange(lo, hi), fb, nb)[None]
                self.groups.append(_Group(t + lo - start, t + hi - start, 1, nb, pages,
                                          (fb - row_fb) * self.block, *self._bias(vis)))
            t += length

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        K, V = kv.k[layer], kv.v[layer]  # [KVH, slots, D]
        K.index_copy_(1, self.write_slots, k.transpose(0, 1))
        V.index_copy_(1, self.write_slots, v.transpose(0, 1))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for g in self.groups:
            if id(g.pages) not in gathered:
                gathered[id(g.pages)] = self._gather(layer, g)
            kg, vg = gathered[id(g.pages)]
            span = slice(g.key_offset, g.key_offset + g.n_blocks * self.block)
            out[g.begin:g.end] = self._attend(g, q[g.begin:g.end], kg[:, :, span], vg[:, :, span]).to(q.dtype)
        return out

    def _gather(self, layer: int, g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's pages of one layer -> K, V as float32 [rows, KVH, keys, D]."""
        kv = self.kv
        kvh, dim = kv.num_kv_heads, kv.head_dim
        shape = (kvh, g.rows, -1, dim)
        Kp = kv.k[layer].view(kvh, -1, kv.page_size, dim)
        Vp = kv.v[layer].view(kvh, -1, kv.page_size, dim)
        return tuple(P.index_select(1, g.pages).view(shape).transpose(0, 1).float().contiguous() for P in (Kp, Vp))

    def _attend(self, g: _Group, q: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor) -> torch.Tensor:
        """q [tokens, H, D], K/V [rows, KVH, keys, D] -> [tokens, H, D] float32 for one group."""
        kvh, dim, blk = self.kv.num_kv_heads, self.kv.head_dim, self.block
        heads = q.shape[1]
        G = heads // kvh
        R, n = g.rows, (g.end - g.begin) // g.rows  # n query tokens per gathered row
        # Queries of one KV head: its G query heads x the row's n tokens, token-major,
        # scaled first (a correctly rounded multiply: the same bits in any lane), zero rows
        # padding the gemm's tile.
        M, Mp = g.queries, g.bias.shape[2]
        qg = torch.zeros(R, kvh, Mp, dim, dtype=torch.float32, device=q.device)
        qg[:, :, :M] = (q.float() * (dim ** -0.5)).view(R, n, kvh, G, dim).permute(0, 2, 1, 3, 4).reshape(
            R, kvh, M, dim)
        s = torch.matmul(qg, kg.transpose(-1, -2))  # [R, KVH, Mp, N]
        s += g.bias  # -inf where hidden: exp gives an exact 0 there
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
        pb = p.view(R, kvh, Mp, g.n_blocks, blk)
        denom = pb.sum(dim=-1).cumsum(dim=-1)[..., -1:]  # [R, KVH, Mp, 1], blocks in order
        ob = torch.matmul(pb.transpose(2, 3), vg.view(R, kvh, g.n_blocks, blk, dim))  # [R, KVH, nb, Mp, D]
        o = ob.cumsum(dim=2)[:, :, -1] / denom  # [R, KVH, Mp, D]
        o = o[:, :, :M].view(R, kvh, n, G, dim).permute(0, 2, 1, 3, 4)
        return o.reshape(R * n, heads, dim)
