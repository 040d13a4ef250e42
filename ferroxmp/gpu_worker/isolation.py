"""Batch isolation: a row the worker cannot compute fails alone, and the worker stays
in step with the scheduler.

Under overlap the scheduler plans batch N+1 before it hears of N. If N's forward
raised, N+1 (and maybe N+2) still name N's rows and start the rows N started; if
the worker then refused them whole ("step names row 6, which no NewRow started"),
one bad row would fail every request behind it. So:

- A failed forward still applies its batch's bookkeeping (its NewRows are
  registered) and reports every row it touched in `BatchResult.row_errors`.
- A failed row (forward or sampling) is remembered; a later step naming it is not
  computed but reported again in `row_errors`, and the rest of that batch runs.
- A NewRow for the slot clears the failure: the slot holds a new request.

Invariant: every row of a batch is in exactly one of `rows` (sampled), `row_errors`
(failed), or neither (a prefill chunk computed without sampling).
"""
from __future__ import annotations

import time

from ferroxmp.protocol import BatchResult, ForwardBatch


def skip_failed(failed: dict[int, str], batch: ForwardBatch) -> tuple[ForwardBatch, dict[int, str]]:
    """The batch without steps of rows that failed earlier, and {row: why} for those."""
    for nr in batch.new_rows:
        failed.pop(nr.row, None)
    skipped = {s.row: f"the row failed in an earlier batch: {failed[s.row]}"
               for s in batch.steps if s.row in failed}
    if not skipped:
        return batch, {}
    steps = [s for s in batch.steps if s.row not in skipped]
    return ForwardBatch(batch.batch_id, batch.new_rows, steps), skipped


def fail_batch(failed: dict[int, str], rows: dict, staged: dict, batch: ForwardBatch, why: str,
               t0: float) -> BatchResult:
    """A forward that raised: register its new rows, fail every row it touched."""
    rows.update(staged)
    errors = {r: why for r in {s.row for s in batch.steps} | set(staged)}
    failed.update(errors)
    return BatchResult(batch_id=batch.batch_id, row_errors=errors, compute_s=time.perf_counter() - t0)
