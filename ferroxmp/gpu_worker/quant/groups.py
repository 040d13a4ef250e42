"""Groups: a [rows, cols] weight kept in groups of 32 values along each row, as a GGUF
file stores it; repacked for its CPU kernel once the model is built (Int4x16 / Int8x16,
int4x16.c), multiplied as it is on a GPU (triton_groups.py).

Formats (GROUP = 32 values, scales float16):
- int4: w = q * d + m, q in 0..15, two values a byte: byte j of a group holds value j in
  its low nibble and value j + 16 in its high one. This is GGUF's Q4_1 layout (Q4_0 is
  the case m = -8 d), so those files load without touching a value.
- int8: w = q * d, q in -127..127: GGUF's Q8_0.

Job: the one form of a quantized weight from the loader to the model. It is sliced like
the float tensor it replaces (rows; columns at group boundaries: tensor-parallel shards),
concatenated (fused qkv, gate/up), padded with zero rows (the last vocabulary shard), read
row by row (the embedding) and called like F.linear (on CPU through a packed copy made
for the call: packed.pack makes the one the model keeps, which a tied head shares with
the embedding). On a CUDA device it is called as it is, through triton_groups.py's
kernels (both formats, this layout).

Invariants: cols % 32 == 0; q, d, m have the same rows; `dequantize()` is computed by
torch from the fields (not by the kernel), so it is an independent reference for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


GROUP = 32


@dataclass
class Groups:
    q: torch.Tensor            # int4: uint8 [rows, cols / 2]; int8: int8 [rows, cols]
    d: torch.Tensor            # float16 [rows, cols / 32]
    m: Optional[torch.Tensor]  # int4: float16 [rows, cols / 32]; int8: None

    @property
    def format(self) -> str:
        return "int8" if self.m is None else "int4"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.d.shape[0], self.d.shape[1] * GROUP))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    # --- making one ---------------------------------------------------------------------
    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str) -> "Groups":
        """Round to nearest on each group's grid: int8 symmetric (d = max|w| / 127), int4
        from the group's min to its max (d = (max - min) / 15, m = min). The scales are
        rounded to float16 first and q is computed against the rounded ones."""
        rows, cols = w.shape
        g = w.float().reshape(rows, cols // GROUP, GROUP)
        if fmt == "int8":
            d = (g.abs().amax(-1) / 127).half()
            step = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
            q = torch.round(g / step[..., None]).clamp_(-127, 127).to(torch.int8)
            return cls(q.reshape(rows, cols).contiguous(), d.contiguous(), None)
        lo, hi = g.amin(-1), g.amax(-1)
        d, m = ((hi - lo) / 15).half(), lo.half()
        step = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
        q = torch.round((g - m.float()[..., None]) / step[..., None]).clamp_(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        return cls(packed.reshape(rows, cols // 2).contiguous(), d.contiguous(), m.contiguous())

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str) -> "Groups":
        """GGUF blocks ([rows, row_bytes], as stored) of Q4_0, Q4_1 or Q8_0, values unchanged;
        Q4_K's values unchanged, its sub-blocks' scales (d * 6-bit scale, dmin * 6-bit min)
        rounded once to float16."""
        if type_name == "Q4_K":
            return cls._from_q4_k(np.asarray(raw))
        rows = raw.shape[0]
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
        b = torch.from_numpy(np.array(raw).reshape(rows, -1, size))  # a copy: the file is mapped read-only
        half = lambda lo, hi: b[..., lo:hi].contiguous().view(torch.float16)[..., 0].contiguous()  # noqa: E731
        if type_name == "Q8_0":
            return cls(b[..., 2:].contiguous().view(torch.int8).reshape(rows, -1).contiguous(), half(0, 2), None)
        d = half(0, 2)
        m = half(2, 4) if type_name == "Q4_1" else (d.float() * -8).half()
        if not torch.isfinite(m).all():
            raise ValueError("a Q4_0 scale too large for float16 once multiplied by 8")
        start = 4 if type_name == "Q4_1" else 2
        return cls(b[..., start:].contiguous().reshape(rows, -1).contiguous(), d, m)

    @classmethod
    def _from_q4_k(cls, raw: np.ndarray) -> "Groups":
        """Q4_K: super-blocks of 256 values (144 bytes: float16 d and dmin, 12 bytes of
        6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of nibbles; a sub-block's
        value is d * scale * q - dmin * min). Each sub-block is one group here: its 32 q
        as stored, d = d * scale and m = -dmin * min (products exact in float32, then
        float16). The nibbles of 64 values c*64 .. c*64+63 sit in 32 bytes, low nibbles
        the first sub-block; a group here wants byte j = value j | value j + 16 << 4."""
        rows = raw.shape[0]
        b = raw.reshape(rows, -1, 144)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        s = b[..., 4:16].astype(np.int32)
        lo6, hi2 = s[..., 0:4] & 63, s[..., 0:4] >> 6   # bytes 0-3: scales 0-3 (+ 2 high bits of 4-7)
        mlo6, mhi2 = s[..., 4:8] & 63, s[..., 4:8] >> 6  # bytes 4-7: mins 0-3 (+ 2 high bits of mins 4-7)
        scale = np.concatenate([lo6, (s[..., 8:12] & 15) | (hi2 << 4)], axis=-1)
        mins = np.concatenate([mlo6, (s[..., 8:12] >> 4) | (mhi2 << 4)], axis=-1)
        qs = b[..., 16:144].reshape(rows, -1, 4, 32)
        v = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 32)  # [rows, groups, 32] in order
        q = (v[..., :16] | (v[..., 16:] << 4)).reshape(rows, -1)
        with np.errstate(over="ignore"):
            dg = (d * scale).astype(np.float16).reshape(rows, -1)
            mg = (-(dmin * mins)).astype(np.float16).reshape(rows, -1)
        if not (np.isfinite(dg).all() and np.isfinite(mg).all()):
            raise ValueError("a Q4_K sub-block scale too large for float16")
        return cls(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(dg), torch.from_numpy(mg))

    # --- reading it -----------------------------------------------------------------------
    def values(self) -> torch.Tensor:
        """q as integers [rows, cols] (int4 unpacked from its nibbles)."""
        if self.m is None:
            return self.q.to(torch.int32)
        b = self.q.reshape(self.q.shape[0], -1, GROUP // 2)
        return torch.cat([b & 15, b >> 4], dim=-1).reshape(self.q.shape[0], -1).to(torch.int32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.shape
        v = self.values().float().reshape(rows, -1, GROUP) * self.d.float()[..., None]
        if self.m is not None:
            v = v + self.m.float()[..., None]
        return v.reshape(rows, cols).to(dtype)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Embedding rows `ids`, dequantized: [len(ids), cols] in `dtype`."""
        return self[ids].dequantize(dtype)

    def __getitem__(self, index) -> "Groups":
        """A part as `tensor[index]` would take it: rows (a slice or index tensor), then
        optionally columns (a slice on group boundaries)."""
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0] if index else slice(None)
        q, d, m = self.q[rows], self.d[rows], None if self.m is None else self.m[rows]
        if len(index) > 1:
            c = index[1]
            lo, hi, _ = c.indices(self.shape[1])
            if lo % GROUP or hi % GROUP:
                raise ValueError(f"columns {lo}:{hi} cut a group of {GROUP}: this split of the weight cannot "
                                 "stay quantized")
            per = 2 if self.m is not None else 1
            q = q[:, lo // per: hi // per]
            d, m = d[:, lo // GROUP: hi // GROUP], None if m is None else m[:, lo // GROUP: hi // GROUP]
        return Groups(q.contiguous(), d.contiguous(), None if m is None else m.contiguous())

    def pad_rows(self, n: int) -> "Groups":
        """`n` zero rows appended (q, d and m zero: they dequantize and multiply to 0)."""
        if n == 0:
            return self
        z = lambda t: None if t is None else torch.cat([t, t.new_zeros(n, t.shape[1])])  # noqa: E731
        return Groups(z(self.q), z(self.d), z(self.m))

    def to(self, device: torch.device) -> "Groups":
        """On `device` (CPU: groups.c / int4x16.c; CUDA: triton_groups.py)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Groups(move(self.q), move(self.d), move(self.m))

    @property
    def on_cpu(self) -> bool:
        return self.q.device.type == "cpu"

    # --- multiplying by it ----------------------------------------------------------------
    def packed(self):
        """The form the model keeps on CPU: repacked in blocks of 16 rows for int4x16.c
        (Int4x16 / Int8x16). On a GPU the Triton kernels read this layout itself."""
        if not self.on_cpu:
            return self
        from ferroxmp.gpu_worker.quant.int4x16 import Int4x16, Int8x16
        return (Int8x16 if self.m is None else Int4x16).from_groups(self)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.on_cpu:
            from ferroxmp.gpu_worker.quant.triton_groups import groups_linear
            return groups_linear(x, self, bias)
        return self.packed()(x, bias)


def cat_rows(parts: list) -> "torch.Tensor | Groups":
    """torch.cat along rows for float tensors, or for Groups of one format (never a mix)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, Groups) for p in parts) and len({p.format for p in parts}) == 1:
        cat = lambda f: None if f(parts[0]) is None else torch.cat([f(p) for p in parts])  # noqa: E731
        return Groups(cat(lambda p: p.q), cat(lambda p: p.d), cat(lambda p: p.m))
    raise TypeError("cannot fuse weights of different formats into one matmul")
