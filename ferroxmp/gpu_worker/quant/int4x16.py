"""Int4x16 / Int8x16: an int4 / int8 weight in the layout its kernel multiplies
(int4x16.c): blocks of 16 rows, each group of 32 values a block holds as 256 (int4) or
512 (int8) bytes that registers of 16 lanes load; activations rounded per group of 32 to
a 16-bit grid (two int8 digits).

Job: the form every int4 / int8 Groups takes once the model is built (packed.pack): called like
F.linear for any number of activation rows (the kernel beats widening to float32 for a
GEMM at every chunk size measured: docs/BENCHMARKS.md 24), and
read row by row (the embedding; a head tied to it is the same object). Loading, cutting
and fusing stay with Groups (canonical GGUF layout); this is made once from the finished
weight.

Invariants: the values, d and m are those of the Groups it was made from (a padded last
block holds zeros); `dequantize()` is computed by torch from the fields, an independent
reference for the kernel's layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ferroxmp.gpu_worker.quant.native import library, ptr

GROUP, BLOCK = 32, 16
_PACK_ROWS = 4096  # rows repacked at a time (the int32 values of a whole head would be ~4x its float size)


@dataclass
class Int4x16:
    q: torch.Tensor  # uint8 [blocks, groups, 256]
    d: torch.Tensor  # float16 [blocks, groups, 16]
    m: Optional[torch.Tensor]  # float16 [blocks, groups, 16] (Int8x16: None)
    rows: int

    format = "int4"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.d.shape[1] * GROUP))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    @staticmethod
    def _lanes(t: torch.Tensor, nb: int, G: int) -> torch.Tensor:
        """Per-group scales [rows, groups] -> [blocks, groups, 16] (a block's rows in lanes)."""
        return t.reshape(nb, BLOCK, G).transpose(1, 2).contiguous()

    @staticmethod
    def _blocks(g):
        """Groups `g` with zero rows up to a multiple of 16, its groups a row and its blocks."""
        g = g.pad_rows(-g.shape[0] % BLOCK)
        return g, g.shape[1] // GROUP, g.shape[0] // BLOCK

    @classmethod
    def from_groups(cls, g) -> "Int4x16":
        """The same values as int4 Groups `g`, rows padded with zeros to a multiple of 16."""
        rows = g.shape[0]
        g, G, nb = cls._blocks(g)
        q = torch.empty(nb, G, 256, dtype=torch.uint8)
        for lo in range(0, g.shape[0], _PACK_ROWS):
            part = g[lo:lo + _PACK_ROWS]
            # value 8p + 4h + c of a group -> pair p, plane h (low/high nibble), lane (row), c
            v = part.values().to(torch.uint8).reshape(-1, BLOCK, G, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
            q[lo // BLOCK:(lo + part.shape[0]) // BLOCK] = (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(-1, G, 256)
        return cls(q, cls._lanes(g.d, nb, G), cls._lanes(g.m, nb, G), rows)

    def values(self) -> torch.Tensor:
        """q as integers [rows padded to blocks, groups, 32], each group's values in order."""
        nb, G, _ = self.q.shape
        b = self.q.reshape(nb, G, 4, BLOCK, 4)
        v = torch.stack([b & 15, b >> 4], dim=-2)  # [nb, G, p, row, h, c]
        return v.permute(0, 3, 1, 2, 4, 5).reshape(nb * BLOCK, G, GROUP)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        nb, G, _ = self.q.shape
        rows = lambda t: t.transpose(1, 2).reshape(nb * BLOCK, G, 1).float()  # noqa: E731
        w = self.values().float() * rows(self.d)
        if self.m is not None:
            w = w + rows(self.m)
        return w.reshape(nb * BLOCK, G * GROUP)[:self.rows].to(dtype)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Embedding rows `ids`: [len(ids), cols] in `dtype`."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.shape[0], self.shape[1])
        library().int4x16_rows(flat.shape[0], ptr(flat), self.shape[1], ptr(self.q), ptr(self.d),
                               None if self.m is None else ptr(self.m), ptr(out))
        return out.reshape(*ids.shape, -1).to(dtype)

    def to(self, device: torch.device) -> "Int4x16":
        if torch.device(device).type != "cpu":
            raise RuntimeError("int4/int8 weights run through CPU kernels only")
        return self

    def _mm(self, lib, x2: torch.Tensor, scratch: torch.Tensor, y: torch.Tensor) -> None:
        rows, cols = self.shape
        lib.int4x16_mm(x2.shape[0], rows, cols, ptr(x2), ptr(self.q), ptr(self.d), ptr(self.m), ptr(scratch), ptr(y))

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows, cols = self.shape
        x2 = x.reshape(-1, cols).float().contiguous()
        lib = library()
        y = torch.empty(x2.shape[0], rows)
        self._mm(lib, x2, torch.empty(lib.int4x16_scratch(x2.shape[0], cols), dtype=torch.uint8), y)
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*x.shape[:-1], rows).to(x.dtype)


@dataclass
class Int8x16(Int4x16):
    """An int8 weight (w = q * d) in the same blocks of 16 rows: a group of 32 values of the
    16 rows is 512 bytes, 8 chunks of 64 (chunk j: each row's values 4j .. 4j+3, as the
    int4 planes); q stays signed (the kernel reads it as q + 128 with VNNI, as |q| and a
    sign otherwise)."""
    format = "int8"

    @classmethod
    def from_groups(cls, g) -> "Int8x16":
        """The same values as int8 Groups `g`, rows padded with zeros to a multiple of 16."""
        rows = g.shape[0]
        g, G, nb = cls._blocks(g)
        # value 4j + c of a group -> chunk j, lane (row), c
        q = g.q.reshape(nb, BLOCK, G, 8, 4).permute(0, 2, 3, 1, 4).reshape(nb, G, 512).contiguous()
        return cls(q, cls._lanes(g.d, nb, G), None, rows)

    def values(self) -> torch.Tensor:
        nb, G, _ = self.q.shape
        return self.q.reshape(nb, G, 8, BLOCK, 4).permute(0, 3, 1, 2, 4).reshape(nb * BLOCK, G, GROUP)

    def _mm(self, lib, x2: torch.Tensor, scratch: torch.Tensor, y: torch.Tensor) -> None:
        rows, cols = self.shape
        lib.int8x16_mm(x2.shape[0], rows, cols, ptr(x2), ptr(self.q), ptr(self.d), ptr(scratch), ptr(y))
