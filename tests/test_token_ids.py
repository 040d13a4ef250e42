"""Token ids are one int32 buffer per row, end to end, and a decode step copies none of them.

Measured before: a request's ids changed representation about nine times between the
HTTP body and the worker (lists, int32 arrays, bytes, tensors), and the worker copied a
row's whole token list to numpy on every speculative step. Now the wire's int32 bytes
are copied once into a TokenIds on each side (scheduler, worker) and grown in place.

The oracle for "no copy per step": every conversion between representations goes
through `protocol.pack_ids` / `unpack_ids` / `TokenIds(...)` / `TokenIds.packed`;
wrapped, they count the ids they convert. Two engines decode the same number of rows
and steps, one with prompts 8x longer: if any conversion on the decode path touched a
row's context, the long run would convert more ids. The rows' buffers must also be the
same objects before and after the decode steps (grown in place, never rebuilt).
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from engine import LocalEngine
from ferroxmp import protocol, token_ids
from ferroxmp.token_ids import TokenIds


def test_token_ids_grow_in_place_and_views_are_not_copies():
    t = TokenIds(np.array([5, 6, 7], np.int32))
    buf = t._buf
    for i in range(10):
        t.append(100 + i)
    assert t.array.tolist() == [5, 6, 7] + list(range(100, 110))
    assert t._buf is buf and np.shares_memory(t.array, buf), "grew though the capacity sufficed"
    t.extend(np.arange(50, dtype=np.int32))
    assert len(t) == 63 and t[-1] == 49 and t._buf is not buf  # doubled once
    assert np.frombuffer(t.packed(60), "<i4").tolist() == [47, 48, 49]
    assert t.ends_with([48, 49]) and not t.ends_with([49, 48]) and not t.ends_with([])
    t.truncate(3)
    assert t.array.tolist() == [5, 6, 7] and TokenIds.from_wire(t.packed()).array.tolist() == [5, 6, 7]


class Counted:
    """Wraps the conversion functions wherever they were imported; counts ids converted."""

    def __init__(self, monkeypatch):
        self.ids = 0
        for name in ("pack_ids", "unpack_ids"):
            orig = getattr(protocol, name)
            wrapped = self._wrap(orig)
            for mod in list(sys.modules.values()):
                if getattr(mod, "__name__", "").startswith(("ferroxmp", "engine")) and getattr(mod, name, None) is orig:
                    monkeypatch.setattr(mod, name, wrapped)
        init, packed = TokenIds.__init__, TokenIds.packed
        counter = self

        def counting_init(self, ids=()):
            init(self, ids)
            counter.ids += len(self)

        def counting_packed(self, start=0, end=None):
            out = packed(self, start, end)
            counter.ids += len(out) // 4
            return out
        monkeypatch.setattr(token_ids.TokenIds, "__init__", counting_init)
        monkeypatch.setattr(token_ids.TokenIds, "packed", counting_packed)

    def _wrap(self, fn):
        def counted(x):
            out = fn(x)
            self.ids += len(out) // 4 if isinstance(out, bytes) else len(out)
            return out
        return counted


def _decode_conversions(model: str, prompt_len: int, monkeypatch) -> int:
    """Ids converted during 12 decode steps of 3 rows."""
    eng = LocalEngine(model, num_pages=256, page_size=4, max_batch_tokens=2048, max_rows=4)
    try:
        rng = np.random.default_rng(prompt_len)
        for i in range(3):
            eng.submit(rng.integers(3, 900, prompt_len).tolist(), max_tokens=40, ignore_eos=True)
        eng.step()  # every prompt prefilled whole: every row decodes from here
        reqs = list(eng.core.requests.values())
        assert all(r.computed >= prompt_len for r in reqs)
        rows = {r.row: eng.runner.rows[r.row].tokens for r in reqs}
        sched = {r.rid: r.ids for r in reqs}
        with monkeypatch.context() as m:
            c = Counted(m)
            for _ in range(12):
                assert eng.step()
            during = c.ids
        assert all(eng.runner.rows[row].tokens is t for row, t in rows.items()), "a worker row's ids were rebuilt"
        assert all(r.ids is sched[r.rid] for r in reqs), "a request's ids were rebuilt"
        assert all(np.shares_memory(r.tokens, r.ids._buf) for r in reqs), "Request.tokens is a copy"
        assert all(len(eng.outputs[r.rid]) >= 12 for r in reqs)
        return during
    finally:
        eng.close()


def test_a_decode_step_converts_no_ids_of_the_rows_context(tiny_models, monkeypatch):
    short = _decode_conversions(tiny_models["llama"], 24, monkeypatch)
    long = _decode_conversions(tiny_models["llama"], 8 * 24, monkeypatch)
    assert short == long, f"decode converted {short} ids with 24-token prompts, {long} with 192"
    # What remains per step and row: the result's row and token (packed, unpacked), the
    # RowOut's token (packed); a bound that a copy of any context (>= 24 ids) would break.
    assert short <= 12 * 3 * 6, short


@pytest.mark.parametrize("k", [0, 4])
def test_speculation_drafts_from_the_rows_buffer_without_copying_it(tiny_models, monkeypatch, k):
    """propose() reads the row's own int32 buffer: the array it gets is a view of it."""
    from ferroxmp.gpu_worker import runner as runner_mod
    seen = []
    orig = runner_mod.propose

    def spy(tokens, n):  # a view (base set) of int32 ids: not a list, not a converted copy
        seen.append(isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.base is not None)
        return orig(tokens, n)
    monkeypatch.setattr(runner_mod, "propose", spy)
    eng = LocalEngine(tiny_models["llama"], num_pages=128, page_size=4, max_batch_tokens=256, spec_tokens=k)
    try:
        eng.generate([5, 6, 7, 8] * 6, max_tokens=8, ignore_eos=True)
        assert bool(seen) == bool(k), "drafting ran without a budget, or not with one"
        assert all(seen), "propose got a copy of the row's ids"
    finally:
        eng.close()
