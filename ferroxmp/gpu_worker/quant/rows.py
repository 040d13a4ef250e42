"""Int8Rows: a [out, in] weight as int8 values and one float32 scale per output row
(symmetric, w ~= q * scale, q in [-127, 127]).

Job: the unpacked form of a quantized weight between the loader and the model: it is
sliced like the float tensor it replaces (a tensor-parallel shard: rows, or columns with
the full row's scale kept, so a shard holds exactly the values tp=1 holds), concatenated
(fused qkv, gate/up), padded with zero rows (the last vocabulary shard), and read row by
row for the embedding lookup.

Invariants: q.shape == (rows, cols), scale.shape == (rows,); a scale is never 0 for a
non-zero row; `dequantize()` is the float reference every quantized matmul is tested
against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Rows:
    format = "int8"
    q: torch.Tensor      # int8 [rows, cols]
    scale: torch.Tensor  # float32 [rows]

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Rows":
        """Round-to-nearest per row, scale = max |w| / 127 (an all-zero row gets scale 1)."""
        w = w.float()
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def __getitem__(self, index) -> "Int8Rows":
        """A slice as `tensor[index]` would take it: rows cut q and scale; columns cut q only."""
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0] if index else slice(None)
        q = self.q[index].contiguous() if index else self.q
        return Int8Rows(q, self.scale[rows].contiguous())

    def pad_rows(self, n: int) -> "Int8Rows":
        """`n` zero rows appended (scale 1: they dequantize to 0)."""
        if n == 0:
            return self
        return Int8Rows(torch.cat([self.q, self.q.new_zeros(n, self.q.shape[1])]),
                        torch.cat([self.scale, self.scale.new_ones(n)]))

    def to(self, device: torch.device) -> "Int8Rows":
        return Int8Rows(self.q.to(device), self.scale.to(device))

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Embedding rows `ids`, dequantized: [len(ids), cols] in `dtype`."""
        return (self.q[ids].float() * self.scale[ids][:, None]).to(dtype)


def cat_rows(parts: list) -> "torch.Tensor | Int8Rows":
    """torch.cat along rows for float tensors, or for Int8Rows (never a mix)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, Int8Rows) for p in parts):
        return Int8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    raise TypeError("cannot fuse quantized and float weights into one matmul")
