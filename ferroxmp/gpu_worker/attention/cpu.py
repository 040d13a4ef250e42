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
- Decode rows: one SDPA call for all of them; the G query heads sharing a KV head
  become G queries of that head (GQA without repeating K/V). Their K/V are read in place
  from the decode mirror (`decode_mirror.py`: each decoding row's K/V kept contiguous
  from step to step, filled once from the pool); without it (sliding window, or over its
  budget) they are gathered from the pool once per layer into a reused buffer. Keys past
  the longest row's position are not read; the padding mask is built once per step,
  and skipped when every row reads exactly its span.
- --kv-cache-dtype float16/bfloat16 (a pool narrower than the model's dtype): the step's
  K/V are rounded to the pool's dtype before anything reads them, so what attention
  sees of a position is the same whether it was computed this step or read back from
  the pool (warm == cold still holds); gathered K/V are widened to the model's dtype,
  and the decode mirror holds the widened values.
- A chunk from position 0 with no window in the way uses SDPA's own causal path (no
  mask, upper blocks skipped); a chunk on top of earlier positions (adopted or earlier
  chunks) gets an explicit mask. Both add exactly 0 for visible keys and drop hidden
  ones, so warm == cold holds to the bit for the same chunk over the same pages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ferroxmp.gpu_worker.attention.base import AttentionBackend, StepPlan
from ferroxmp.gpu_worker.attention.decode_mirror import DecodeMirror
from ferroxmp.gpu_worker.attention.page_decode import PageDecode
from ferroxmp.gpu_worker.quant.fused_decode import FUSED_ROWS


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
    pages: Optional[torch.Tensor]  # [B * P] to gather (padding reads page 0, masked); None: mirror
    n_rows: int
    n_pages: int
    span: int  # keys read per row: the longest row's span (shorter rows are masked)
    mask: Optional[torch.Tensor]  # [B, 1, 1, span] bool (slot order with the mirror); None = all visible
    slots: Optional[torch.Tensor] = None  # mirror slot of each decode row (internal order)
    starts: Optional[torch.Tensor] = None  # each row's new position (internal order)
    by_slot: Optional[torch.Tensor] = None  # internal index of each slot; None when slot == index
    row_pages: Optional[tuple] = None  # (page offsets [B + 1], pages): PageDecode reads the pool


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, kv, window: Optional[int], num_heads: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, native_decode: bool = False):
        if kv.layout != "hnd":
            raise ValueError("the torch backend needs the KV pool in the 'hnd' layout")
        super().__init__(kv, window, num_heads)
        self.dtype = dtype or kv.dtype  # the model's: what attention computes in
        self.write_slots: Optional[torch.Tensor] = None
        self.decode: Optional[_Decode] = None
        self.chunks: list[_Chunk] = []
        self._fused: Optional[tuple] = None  # fused_decode_target(): set by prepare
        self._deferred: Optional[StepPlan] = None  # a decode-only step's plan, until it runs eagerly
        # Gathered K/V land in one buffer reused by every layer and step: a fresh tensor of
        # tens of MB per gather is a fresh mmap, and its page faults cost more than the copy.
        self._scratch = torch.empty(0, dtype=kv.dtype, device=kv.device)
        # Decoding rows' K/V kept contiguous between steps (no gather at all), within the
        # pool's own count of tokens (in the mirror's dtype: a float16 pool's float32 mirror
        # may take twice its bytes); models with a sliding window gather.
        # With native_decode (the runner asks for it unless --disable-fused-decode or --tp)
        # decode rows are attended over their pages in the pool in one native call
        # (page_decode.py) where the kernels load, and there is no mirror at all.
        self.page_decode = PageDecode.build(kv, window, self.dtype) if native_decode else None
        budget = kv.nbytes * self.dtype.itemsize // kv.dtype.itemsize
        self.mirror = None if window is not None or self.page_decode is not None else DecodeMirror(
            kv.num_layers, kv.num_kv_heads, kv.head_dim, self.dtype, kv.device, budget_bytes=budget)

    def forget(self, row: int) -> None:
        if self.mirror is not None:
            self.mirror.forget(row)

    def reset(self) -> None:
        if self.mirror is not None:
            self.mirror.reset()

    def idle(self) -> None:
        # The mirror holds a second copy of the decoding rows' K/V (~100 MB at 16 rows of
        # SmolLM2 in float32) and the gather scratch the largest gather's: both refill.
        if self.mirror is not None:
            self.mirror.release()
        self._scratch = torch.empty(0, dtype=self.kv.dtype, device=self.kv.device)

    def fused_decode_target(self):
        return self._fused

    def _gather(self, pool: torch.Tensor, pages: torch.Tensor, which: int) -> torch.Tensor:
        """pool [KVH, num_pages, page_size, D] -> its `pages` [KVH, n, page_size, D], copied
        into half `which` (0: K, 1: V) of the scratch buffer."""
        shape = (pool.shape[0], len(pages)) + tuple(pool.shape[2:])
        n = math.prod(shape)
        if self._scratch.numel() < 2 * n:
            self._scratch = torch.empty(2 * n, dtype=pool.dtype, device=pool.device)
        return torch.index_select(pool, 1, pages, out=self._scratch[which * n:(which + 1) * n].view(shape))

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.kv.device)

    def _visible(self, key_pos: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
        ok = key_pos <= q_pos
        return ok & (key_pos > q_pos - self.window) if self.window is not None else ok

    def prepare(self, step: StepPlan) -> None:
        self.write_slots = self._tensor(step.write_slots)
        self.decode, self.chunks, self._fused, self._deferred = None, [], None, None
        if self.page_decode is not None and step.num_tokens <= FUSED_ROWS:
            # Few tokens (decode rows, a speculative verify, a short prompt): a fused step
            # (quant/fused_decode.c; it exists only where PageDecode does) reads their
            # pages in the pool itself, so the eager plan is made only if the step runs
            # eagerly (forward). Each token is one of its rows, at its own position over
            # its row's pages: the step writes every token's K/V before any attends, so a
            # chunk's tokens see each other causally, as in the eager path.
            if step.decode_only:  # a token a row: its row's offsets
                page_at = step.kv_indptr
            else:
                row_of = np.repeat(np.arange(len(step.rows)), step.lengths)
                page_at = np.append(step.kv_indptr[row_of], step.kv_indptr[-1])
            self._fused = (self.write_slots, self._tensor(page_at), self._tensor(step.kv_pages))
            self._deferred = step
            return
        self._prepare(step)

    def _prepare(self, step: StepPlan) -> None:
        # Outside inference mode whoever calls (plan() from the runner, a --tp follower's
        # plan() inside inference mode, forward() for a deferred step): the mirror's
        # tensors are updated in place by later plans and must stay ordinary tensors.
        with torch.inference_mode(False):
            self._prepare_step(step)

    def _prepare_step(self, step: StepPlan) -> None:
        counts = np.diff(step.kv_indptr)
        b = step.n_decode
        if b and self.page_decode is not None:
            # A decode-only step (deferred: it did not run fused) has these in its fused target.
            row_pages = self._fused[1:] if self._fused is not None else (
                self._tensor(step.kv_indptr[:b + 1]), self._tensor(step.kv_pages[:step.kv_indptr[b]]))
            self.decode = _Decode(None, b, 0, int(step.starts[:b].max()) + 1, None,
                                  starts=self._tensor(step.starts[:b]), row_pages=row_pages)
        elif b and self.mirror is not None:
            self.decode = self._mirror_decode(step)
        if b and self.decode is None:
            n = int(counts[:b].max())
            cols = np.arange(n)[None, :]
            valid = cols < counts[:b, None]
            idx = np.where(valid, step.kv_indptr[:b, None] + cols, 0)
            pages = np.where(valid, step.kv_pages[idx], 0)
            span = int(step.kv_lens[:b].max())  # keys past every row's query are not read
            key_pos = step.kv_start[:b, None] + np.arange(span)[None, :]
            vis = self._visible(key_pos, step.starts[:b, None])
            mask = None if vis.all() else torch.from_numpy(vis).to(self.kv.device).view(b, 1, 1, span)
            self.decode = _Decode(self._tensor(pages.reshape(-1)), b, n, span, mask)
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

    def _mirror_decode(self, step: StepPlan) -> Optional[_Decode]:
        """The decode rows read from the mirror, or None (over its budget: gather)."""
        b, ps = step.n_decode, step.page_size
        starts = step.starts[:b]

        def fill(i: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
            pages = step.kv_pages[step.kv_indptr[i]:step.kv_indptr[i + 1]]
            idx = self._tensor((pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1)[:start])
            return self.kv.k.index_select(2, idx), self.kv.v.index_select(2, idx)
        index_of = {int(r): i for i, r in enumerate(step.rows[:b])}
        slots = self.mirror.arrange(step.rows[:b], starts, lambda r, start: fill(index_of[r], start))
        if slots is None:
            return None
        by_slot = np.argsort(slots)
        span = int(starts.max()) + 1
        vis = np.arange(span)[None, :] <= starts[by_slot, None]
        mask = None if vis.all() else torch.from_numpy(vis).to(self.kv.device).view(b, 1, 1, span)
        ident = bool((slots == np.arange(b)).all())
        return _Decode(None, b, 0, span, mask, slots=self._tensor(slots), starts=self._tensor(starts),
                       by_slot=None if ident else self._tensor(by_slot))

    def _forward_mirror(self, layer: int, d: _Decode, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> torch.Tensor:
        m, b = self.mirror, d.n_rows
        m.write(layer, d.slots, d.starts, k[:b], v[:b])
        heads, kvh, dim = q.shape[1], m.kv_heads, m.head_dim
        qd = q[:b] if d.by_slot is None else q[:b].index_select(0, d.by_slot)
        od = F.scaled_dot_product_attention(qd.view(b, kvh, heads // kvh, dim), m.k[layer][:b, :, :d.span],
                                            m.v[layer][:b, :, :d.span], attn_mask=d.mask)
        od = od.reshape(b, heads, dim)
        return od if d.by_slot is None else od.index_select(0, d.slots)

    def _widen(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.dtype else t.to(self.dtype)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._deferred is not None:  # a decode-only step that did not run fused
            self._prepare(self._deferred)
            self._deferred = None
        kv = self.kv
        K, V = kv.k[layer], kv.v[layer]  # [KVH, slots, D]
        if kv.dtype != k.dtype:  # --kv-cache-dtype: every reader sees the stored (rounded) values
            k, v = k.to(kv.dtype), v.to(kv.dtype)
        K.index_copy_(1, self.write_slots, k.transpose(0, 1))
        V.index_copy_(1, self.write_slots, v.transpose(0, 1))
        heads, kvh, dim = q.shape[1], kv.num_kv_heads, kv.head_dim
        Kp = K.view(kvh, kv.num_pages, kv.page_size, dim)
        Vp = V.view(kvh, kv.num_pages, kv.page_size, dim)
        outs = []
        d = self.decode
        if d is not None and d.row_pages is not None:
            outs.append(self.page_decode(layer, q[:d.n_rows], d.starts, *d.row_pages, d.span))
        elif d is not None and d.pages is None:  # the mirror takes the stored values, widened
            outs.append(self._forward_mirror(layer, d, q, self._widen(k), self._widen(v)))
        elif d is not None:
            shape = (kvh, d.n_rows, d.n_pages * kv.page_size, dim)
            kd = self._widen(self._gather(Kp, d.pages, 0).view(shape).transpose(0, 1)[:, :, :d.span])
            vd = self._widen(self._gather(Vp, d.pages, 1).view(shape).transpose(0, 1)[:, :, :d.span])
            qd = q[:d.n_rows].view(d.n_rows, kvh, heads // kvh, dim)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask)
            outs.append(od.reshape(d.n_rows, heads, dim))
        for c in self.chunks:
            if c.run is not None:
                kc, vc = Kp[:, c.run[0]:c.run[1]], Vp[:, c.run[0]:c.run[1]]
            else:
                kc, vc = self._gather(Kp, c.pages, 0), self._gather(Vp, c.pages, 1)
            kc = self._widen(kc.reshape(1, kvh, -1, dim)[:, :, :c.span])
            vc = self._widen(vc.reshape(1, kvh, -1, dim)[:, :, :c.span])
            qc = q[c.begin:c.end].transpose(0, 1).unsqueeze(0)  # [1, H, len, D]
            oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, is_causal=c.mask is None,
                                                enable_gqa=heads != kvh)
            outs.append(oc[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
