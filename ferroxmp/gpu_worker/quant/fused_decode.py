"""FusedDecode: a decode step of up to 16 rows through every layer in one native call.

Job: for a model whose linear weights are Groups (--quantization int4/int8, or a Q4/Q8
GGUF) or PackedF32 (float32 in panels), computing in float32 on CPU, run a step whose rows all decode
one token (the single stream's every token; a batch of up to FUSED_ROWS users) as
`fused_decode.c`'s `fused_decode` instead of ~600 eager torch ops. `build` says why not
when it cannot (the model then runs eagerly, as before); `__call__` takes the rows'
embeddings and returns their final hidden states, having written the step's K/V to the
pool as the eager path does (and read each row's K/V back from its pages there).

Invariants: the weights, norms and pool never move after `build` (their addresses are
kept in one ctypes struct).
Used only where the eager path's results are not required to the bit: never under
--deterministic (its batch-invariant matmuls replace model.linear) or --tp.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_int64, c_void_p
from typing import Optional

import torch

from ferroxmp.gpu_worker.quant.int4x16 import Int4x16
from ferroxmp.gpu_worker.quant.native import available, library, ptr
from ferroxmp.gpu_worker.quant.packed import PackedF32, linear

# Rows per fused step: what it saves is the eager step's glue (~600 torch calls), which a
# step of more rows amortizes over its compute.
FUSED_ROWS = 16


class _Lin(ctypes.Structure):
    _fields_ = [("q", c_void_p), ("d", c_void_p), ("m", c_void_p), ("bias", c_void_p), ("n", c_int), ("k", c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p), ("k_norm", c_void_p),
                ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", c_int), ("heads", c_int), ("kv_heads", c_int), ("head_dim", c_int),
                ("hidden", c_int), ("inter", c_int), ("eps", c_float), ("layer", POINTER(_Layer)),
                ("pool_k", c_void_p), ("pool_v", c_void_p), ("pool_slots", c_int64), ("page_size", c_int),
                ("kv_f16", c_int), ("norm", c_void_p), ("head", _Lin), ("embed", _Lin)]


def _addr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _float32(t: Optional[torch.Tensor], keep: list) -> Optional[int]:
    """The address of `t` as contiguous float32 (a converted copy is kept alive in `keep`)."""
    if t is None:
        return None
    t = t.detach().to(torch.float32).contiguous()
    keep.append(t)
    return t.data_ptr()


def _lin(w, bias: Optional[torch.Tensor], keep: list) -> _Lin:
    """Int4x16, Int8x16 (m NULL) or PackedF32 (d NULL: its panels): fused_decode.c tells
    them apart by those fields."""
    n, k = w.shape
    if isinstance(w, PackedF32):
        return _Lin(_addr(w.panels), None, None, _float32(bias, keep), n, k)
    return _Lin(_addr(w.q), _addr(w.d), _addr(w.m), _float32(bias, keep), n, k)


def _fits(w) -> bool:
    """A weight fused_decode.c multiplies: int4 / int8 packed (Int4x16, Int8x16), or float32
    panels (PackedF32) of rows of whole groups of 32 values, as the other weights'."""
    return isinstance(w, Int4x16) or (isinstance(w, PackedF32) and w.in_features % 32 == 0)  # Int8x16 too


class FusedDecode:
    def __init__(self, model, kv, lib):
        cfg = self.cfg = model.cfg
        self.model, self.kv, self.fn, self.scratch_floats = model, kv, lib.fused_decode, lib.fused_decode_scratch
        self.steps_fn = lib.fused_decode_steps
        self._keep: list = []  # float32 copies the struct points at
        layers = (_Layer * cfg.num_layers)(*[_Layer(
            _float32(L.in_norm, self._keep), _float32(L.post_norm, self._keep),
            _float32(L.q_norm, self._keep), _float32(L.k_norm, self._keep),
            _lin(L.w_qkv, L.b_qkv, self._keep), _lin(L.w_o, L.b_o, self._keep),
            _lin(L.w_gate_up, None, self._keep), _lin(L.w_down, None, self._keep)) for L in model.layers])
        self._layers = layers
        self.m = _Model(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                        cfg.intermediate_size, cfg.rms_norm_eps, layers,
                        kv.k.data_ptr(), kv.v.data_ptr(), kv.num_slots, kv.page_size,
                        int(kv.dtype == torch.float16), _float32(model.norm, self._keep))
        # The final norm and LM head in the same call, where this file multiplies the head
        # (float32 panels, int4/int8 blocks): `logits` then asks for them.
        self.has_head = _fits(model.lm_head)
        self.vocab = model.lm_head.shape[0] if self.has_head else None
        if self.has_head:
            self.m.head = _lin(model.lm_head, None, self._keep)
        # The embedding's rows looked up in the call where this file reads the table
        # (float32 panels, int4/int8 blocks; not under --tp, whose lookup is vocab-parallel).
        # Every id the step may see (a prompt's, below the config's vocabulary; a sampled
        # one, below the head's) must be a row of the table: C does not check.
        self.embeds = (_fits(model.embed) and model.embed.shape[1] == cfg.hidden_size
                       and model.embed.shape[0] >= max(cfg.vocab_size, model.lm_head.shape[0]))
        if self.embeds:
            self.m.embed = _lin(model.embed, None, self._keep)
        self._scratch = torch.empty(0)
        self._cap = (0, 0)  # (rows, positions) the scratch holds
        self.max_rows = FUSED_ROWS  # steps of more rows run eagerly
        # A step's outputs with its head (`with_head`): buffers for FUSED_ROWS rows kept from
        # step to step, their first R rows' views kept per row count, since each torch call
        # of a one-row step costs 10-70 us with its code cold after the weights' stream
        # (docs/BENCHMARKS.md 30).
        self._out: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def why_not(model, kv, attn) -> Optional[str]:
        """None when the fused step can run this model on this pool, else the reason."""
        cfg = model.cfg
        if model.linear is not linear:
            return "the model's matmuls are replaced (--deterministic)"
        weights = [w for L in model.layers for w in (L.w_qkv, L.w_o, L.w_gate_up, L.w_down)]
        if not all(_fits(w) for w in weights):
            return "its linear weights are not all packed int4/int8 or float32 panels of rows of whole groups of 32"
        if cfg.dtype != torch.float32 or kv.device.type != "cpu":
            return "it computes in float32 on CPU only"
        if kv.dtype not in (torch.float32, torch.float16):
            return f"it stores K/V as float32 or float16, not {kv.dtype}"
        if attn.window is not None or kv.layout != "hnd":
            return "it needs the CPU attention backend and a model without a sliding window"
        return available()

    @classmethod
    def build(cls, model, kv, attn) -> tuple[Optional["FusedDecode"], Optional[str]]:
        why = cls.why_not(model, kv, attn)
        if why is not None:
            return None, why
        return cls(model, kv, library()), None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_at: torch.Tensor,
                 pages: torch.Tensor) -> torch.Tensor:
        """The step from token ids (int64 [R]) -> their final hidden states [R, hidden] (a
        tensor of their own). positions, slots: int64 [R] on CPU, each row's position and
        pool slot; pages[page_at[r]:page_at[r + 1]]: row r's pages (int64), first to last."""
        h = torch.empty(ids.shape[0], self.cfg.hidden_size) if self.embeds else self.model.embed_ids(ids).contiguous()
        self._run(ids.shape[0], h, ids if self.embeds else None, positions, slots, page_at, pages, None, None)
        return h

    def with_head(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_at: torch.Tensor,
                  pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step from token ids (int64 [R]) through the LM head (only where has_head) ->
        (final hidden states [R, hidden], logits [R, vocab] float32, each row's argmax [R]
        int64: the first of equal logits, the first NaN if any). The three are views of
        buffers the next call overwrites."""
        rows = ids.shape[0]
        h, logits, top = self.with_head_buffers(rows)
        if not self.embeds:  # (as __call__)
            h.copy_(self.model.embed_ids(ids))
        self._run(rows, h, ids if self.embeds else None, positions, slots, page_at, pages, logits, top)
        return h, logits, top

    def steps(self, ids: torch.Tensor, positions: torch.Tensor, page_at: torch.Tensor, pages: torch.Tensor,
              n: int) -> torch.Tensor:
        """`n` greedy decode steps in one call (--decode-steps; needs has_head and embeds):
        ids, positions: int64 [R], step 0's; pages[page_at[r]:page_at[r + 1]]: row r's pages
        up to the one holding position positions[r] + n - 1. -> each step's argmax [n, R]
        int64, the tokens the rows chose (step i's input is step i - 1's choice)."""
        assert self.has_head and self.embeds
        rows = ids.shape[0]
        h, logits, _ = self.with_head_buffers(rows)
        top = torch.empty(n, rows, dtype=torch.int64)
        pos = positions.to(torch.int64).contiguous()
        self._fit_scratch(rows, int(pos.max()) + n)
        self.steps_fn(ctypes.byref(self.m), c_int(rows), c_int(n), ptr(h), ptr(ids), ptr(self.model.cos_table),
                      ptr(self.model.sin_table), ptr(pos), ptr(page_at), ptr(pages), ptr(self._scratch), ptr(logits),
                      ptr(top))
        return top

    def with_head_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if rows not in self._out:
            whole = self._out.get(FUSED_ROWS) or (torch.empty(FUSED_ROWS, self.cfg.hidden_size),
                                                  torch.empty(FUSED_ROWS, self.vocab),
                                                  torch.empty(FUSED_ROWS, dtype=torch.int64))
            self._out[FUSED_ROWS] = whole
            self._out[rows] = tuple(t[:rows] for t in whole)
        return self._out[rows]

    def _fit_scratch(self, rows: int, span: int) -> None:
        if rows > self._cap[0] or span > self._cap[1]:  # grown with room, not sized every step
            self._cap = (max(rows, self._cap[0]), max(span + span // 4, 256))
            self._scratch = torch.empty(self.scratch_floats(ctypes.byref(self.m), c_int(self._cap[0]),
                                                            c_int64(self._cap[1])))

    def _run(self, rows: int, h, ids, positions, slots, page_at, pages, logits, top) -> None:
        m = self.m
        pos = positions.to(torch.int64).contiguous()  # the backend's slot and page tensors are int64 already
        self._fit_scratch(rows, int(pos.max()) + 1)
        self.fn(ctypes.byref(m), c_int(rows), ptr(h), None if ids is None else ptr(ids), ptr(self.model.cos_table),
                ptr(self.model.sin_table), ptr(pos), ptr(slots), ptr(page_at), ptr(pages), ptr(self._scratch),
                None if logits is None else ptr(logits), None if top is None else ptr(top))
