"""The CPU attention backend: torch SDPA over the KV pool in the "hnd" layout.

Job: per step, build the index tensors once (write slots, each row's read pages, masks
only where a mask is needed); per layer, write the step's K/V and attend.

How (and why this is the fast exact path on CPU):
- The pool is `[kv_heads, slots, head_dim]` per layer, so a page of one head is one
  contiguous block: gathering a row's pages is a few large copies per head (4x faster
  than gathering `[page_size, kv_heads, head_dim]` pages and transposing), and the
  gathered K/V are `[kv_heads, positions, head_dim]` as SDPA reads them.
- A chunk whose pages are consecutive in the pool (a cold prefill usually is) reads them
  as a view: no copy at all.
- Decode rows: one gather and one SDPA call for all of them; the G query heads sharing
  a KV head become G queries of that head (GQA without repeating K/V). The padding mask
  is built once per step, and skipped when every row reads exactly its span.
- A chunk from position 0 with no window in the way uses SDPA's own causal path (no
  mask, upper blocks skipped); a chunk on top of earlier positions (adopted or earlier
  chunks) gets an explicit mask. Both add exactly 0 for visible keys and drop hidden
  ones, so warm == cold holds to the bit for the same chunk over the same pages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .attention import AttentionBackend, StepPlan


@dataclass
class _Chunk:
    begin: int  # token range in internal order
    end: int
    pages: Optional[torch.Tensor]  # [n] pages to gather, or None when `run` is used
    run: Optional[tuple[int, int]]  # consecutive pages [first, last + 1): a view, no copy
    span: int  # keys read (positions from the first read slot)
    mask: Optional[torch.Tensor]  # [1, 1, len, span] bool, None = causal from 0


@dataclass
class _Decode:
    pages: torch.Tensor  # [B * P] (padding reads page 0, masked)
    n_rows: int
    n_pages: int
    mask: Optional[torch.Tensor]  # [B, 1, 1, P * page_size] bool; None = every key visible


class TorchBackend(AttentionBackend):
    name = "torch"
    kv_layout = "hnd"

    def __init__(self, kv, window: Optional[int], num_heads: Optional[int] = None):
        if kv.layout != "hnd":
            raise ValueError("the torch backend needs the KV pool in the 'hnd' layout")
        super().__init__(kv, window, num_heads)
        self.write_slots: Optional[torch.Tensor] = None
        self.decode: Optional[_Decode] = None
        self.chunks: list[_Chunk] = []

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.kv.device)

    def _visible(self, key_pos: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
        ok = key_pos <= q_pos
        return ok & (key_pos > q_pos - self.window) if self.window is not None else ok

    def prepare(self, step: StepPlan) -> None:
        ps = step.page_size
        self.write_slots = self._tensor(step.write_slots)
        self.decode, self.chunks = None, []
        counts = np.diff(step.kv_indptr)
        b = step.n_decode
        if b:
            n = int(counts[:b].max())
            cols = np.arange(n)[None, :]
            valid = cols < counts[:b, None]
            idx = np.where(valid, step.kv_indptr[:b, None] + cols, 0)
            pages = np.where(valid, step.kv_pages[idx], 0)
            key_pos = step.kv_start[:b, None] + np.arange(n * ps)[None, :]
            vis = self._visible(key_pos, step.starts[:b, None])
            mask = None if vis.all() else torch.from_numpy(vis).to(self.kv.device).view(b, 1, 1, n * ps)
            self.decode = _Decode(self._tensor(pages.reshape(-1)), b, n, mask)
        t = b
        for i in range(b, len(step.rows)):
            start, length = int(step.starts[i]), int(step.lengths[i])
            pages = step.kv_pages[step.kv_indptr[i]:step.kv_indptr[i + 1]]
            consecutive = bool((np.diff(pages) == 1).all())
            run = (int(pages[0]), int(pages[-1]) + 1) if consecutive else None
            span = int(step.kv_lens[i])
            if start == 0 and step.kv_start[i] == 0 and (self.window is None or length <= self.window):
                mask = None
            else:
                q_pos = np.arange(start, start + length)[:, None]
                key_pos = step.kv_start[i] + np.arange(span)[None, :]
                mask = torch.from_numpy(self._visible(key_pos, q_pos)).to(self.kv.device)[None, None]
            self.chunks.append(_Chunk(t, t + length, None if run else self._tensor(pages), run, span, mask))
            t += length

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        K, V = kv.k[layer], kv.v[layer]  # [KVH, slots, D]
        K.index_copy_(1, self.write_slots, k.transpose(0, 1))
        V.index_copy_(1, self.write_slots, v.transpose(0, 1))
        heads, kvh, dim = q.shape[1], kv.num_kv_heads, kv.head_dim
        Kp = K.view(kvh, kv.num_pages, kv.page_size, dim)
        Vp = V.view(kvh, kv.num_pages, kv.page_size, dim)
        outs = []
        d = self.decode
        if d is not None:
            shape = (kvh, d.n_rows, d.n_pages * kv.page_size, dim)
            kd = Kp.index_select(1, d.pages).view(shape).transpose(0, 1)
            vd = Vp.index_select(1, d.pages).view(shape).transpose(0, 1)
            qd = q[:d.n_rows].view(d.n_rows, kvh, heads // kvh, dim)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask)
            outs.append(od.reshape(d.n_rows, heads, dim))
        for c in self.chunks:
            if c.run is not None:
                kc, vc = Kp[:, c.run[0]:c.run[1]], Vp[:, c.run[0]:c.run[1]]
            else:
                kc, vc = Kp.index_select(1, c.pages), Vp.index_select(1, c.pages)
            kc = kc.reshape(1, kvh, -1, dim)[:, :, :c.span]
            vc = vc.reshape(1, kvh, -1, dim)[:, :, :c.span]
            qc = q[c.begin:c.end].transpose(0, 1).unsqueeze(0)  # [1, H, len, D]
            oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, is_causal=c.mask is None,
                                                enable_gqa=heads != kvh)
            outs.append(oc[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
