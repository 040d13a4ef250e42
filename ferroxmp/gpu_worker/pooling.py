"""Pooling for embedding rows: the final-norm hidden state over a row's prompt, one vector.

An embedding row (`SamplingParams.pooling`) is prefilled like any row, possibly in
several chunks; its last chunk samples one token that nobody reads. This module keeps
what the row's chunks contribute (`Pooled`) and produces the vector on the last one.

Invariants: the vector is the model's final RMS norm applied to the last layer's
output (what transformers calls `last_hidden_state`), in float32, not normalized
(the frontend normalizes and truncates). "last": the last prompt position, which
every row computes whatever it adopted; "mean": the average over every prompt
position and "cls": position 0, both of which need positions the scheduler never
lets such a row adopt from the cache (cache.py), so a chunk starting past what this
row has seen is an error, never a silently wrong mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

MODES = ("last", "mean", "cls")


@dataclass
class Pooled:
    mode: str
    total: Optional[torch.Tensor] = None  # "mean": sum of the normed states so far (float32)
    first: Optional[torch.Tensor] = None  # "cls": position 0's normed state
    seen: int = 0  # prompt positions covered so far (mean/cls need them all, in order)

    def add(self, normed: torch.Tensor, start: int) -> None:
        """Take a chunk's normed hidden states [length, hidden] for positions from `start`."""
        if self.mode == "last":
            return
        if start != self.seen:
            raise ValueError(f"{self.mode} pooling needs every prompt position in order: "
                             f"a chunk starts at {start}, after {self.seen} seen")
        if self.mode == "mean":
            s = normed.float().sum(0)
            self.total = s if self.total is None else self.total + s
        elif start == 0:
            self.first = normed[0].float()
        self.seen += len(normed)

    def vector(self, last: torch.Tensor) -> bytes:
        """The pooled vector as float32 little-endian bytes; `last` is the last position's
        normed state."""
        if self.mode == "mean":
            v = self.total / self.seen
        elif self.mode == "cls":
            v = self.first
        else:
            v = last.float()
        return np.ascontiguousarray(v.cpu().numpy(), dtype="<f4").tobytes()


def normed(model, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm the logits use, on some positions' last-layer states."""
    return model._rms(hidden, model.norm)
