"""InFlight: what the core remembers of a batch the worker holds, until its result.

A step's bulk is its decode rows (one sampled position each); they are kept as
parallel lists — requests, rows, start positions — rather than a (request, step)
pair per row, so a result is applied to them in one pass. Prefill chunks keep
their `RowStep`. Iterating an `InFlight` still yields (request, step) pairs in
the batch's step order: decode rows first, then chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

from ferroxmp.protocol import BatchResult, RowStep, unpack_ids
from ferroxmp.scheduler.request import Request


@dataclass
class InFlight:
    decode: list[Request]  # decode rows in step order (the batch's first steps)
    rows: list[int]  # their row slots
    starts: list[int]  # the position each computes
    chunks: list[tuple[Request, RowStep]] = field(default_factory=list)  # the prefill chunks
    lookahead: bool = False  # some row may take more than one token (drafts, --decode-steps)

    def __iter__(self) -> Iterator[tuple[Request, RowStep]]:
        """(request, step) in step order; a decode row's step is rebuilt (it is
        RowStep(row, start, 1, True) by definition) rather than kept for every row."""
        for req, row, start in zip(self.decode, self.rows, self.starts):
            yield req, RowStep(row, start, 1, True)
        yield from self.chunks

    @property
    def tokens(self) -> int:
        """Tokens the step computes: one per decode row plus the chunks' lengths."""
        return len(self.rows) + sum(step.length for _, step in self.chunks)

    def __len__(self) -> int:
        return len(self.decode) + len(self.chunks)

    def decode_tokens(self, res: BatchResult) -> Optional[list[int]]:
        """The decode rows' sampled ids in step order, if the result reports them first
        and in that order (the worker keeps step order) — else None, and the caller
        matches rows one by one."""
        n = len(self.rows)
        rows, tokens = unpack_ids(res.rows), unpack_ids(res.tokens)
        if n == 0 or min(len(rows), len(tokens)) < n or rows[:n].tolist() != self.rows:
            return None
        return tokens[:n].tolist()
