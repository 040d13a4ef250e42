"""Outcomes, not accounting (issue 25): faults that leave every page count right but the
answers wrong. Each test compares tokens or logits against an oracle run (a solo run,
the batch-of-one run), through the real scheduler core and the real model runner
(tests/engine.py), so a fault in either shows as a different answer.

- An abort while its row sits in a batch in flight: the others' tokens equal their solo
  runs. Releasing the aborted row's pages or slot before that batch reports lets the
  next request take them while the in-flight batch still writes through the row's page
  table.
- Retraction takes the policy's victim (the most recently admitted active row admitted
  after the row that needed the page), asserted by name at every retraction, and every
  row's output still equals its solo run.
- --deterministic gives the same bits at every batch size 1..64 (a tile mis-sized for a
  few batch sizes went unnoticed while the tests sampled only some sizes).
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import LocalEngine
from ferroxmp.scheduler.request import State


def _prompts(n: int, seed: int, lo: int = 6, hi: int = 14) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _solo(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    eng = LocalEngine(model, num_pages=64, page_size=4, radix=False)
    try:
        return [eng.generate(p, max_tokens, ignore_eos=True) for p in prompts]
    finally:
        eng.close()


@pytest.mark.parametrize("when", ["first_batch", "decoding"])
def test_an_abort_with_its_batch_in_flight_leaves_every_other_rows_tokens_equal_to_a_solo_run(tiny_models, when):
    """Three rows run with two batches in flight; one is aborted while a built batch still
    holds it, and a new request arrives at once. The pool is sized so the newcomer can
    only be admitted on the aborted row's pages: if they (or its row slot) came back
    before that batch reported, the in-flight batch would write the aborted row's KV into
    the newcomer's pages. Every surviving and new request must equal its solo run."""
    model = tiny_models["llama"]
    ps = _prompts(4, seed=11)
    max_tokens = 10
    solo = _solo(model, ps, max_tokens)
    # 3 rows x ceil((13 + 10) / 4) <= 18 pages; the 4th needs the victim's.
    eng = LocalEngine(model, num_pages=18, page_size=4, max_rows=3, overlap=True, radix=False)
    try:
        rids = [eng.submit(p, max_tokens, ignore_eos=True) for p in ps[:3]]
        victim = rids[1]
        if when == "decoding":
            eng.run_until(lambda: len(eng.outputs[victim]) >= 3)
        else:
            eng.build()  # the victim's prefill is built, not yet computed
        assert any(s.row == eng.request(victim).row for b in eng.queue for s in b.steps), \
            "the victim is not in a batch in flight: this test would prove nothing"
        eng.core.abort(victim)
        late = eng.submit(ps[3], max_tokens, ignore_eos=True)
        eng.run_to_idle()
        for i, rid in enumerate(rids + [late]):
            if rid != victim:
                assert eng.outputs[rid] == solo[i], f"request {i} changed by an abort beside it"
        assert eng.finish[victim] == "abort"
    finally:
        eng.close()


def _policy_victim(core) -> str | None:
    """The row the stated policy retracts in the next plan, read off the state before it:
    decode rows ask for pages oldest first (admission order); those past what the pool can
    give (free + evictable) fail, and the first failing row with an active row admitted
    after it retracts the most recently admitted such row. One retraction at a time."""
    live = list(core.live.values())
    if any(r.retracting for r in live):
        return None
    ps = core.cfg.page_size
    boundary = [r for r in live if r.state is State.DECODING
                and r.sampled_scheduled + r.sampled_before < r.params.max_tokens
                and r.scheduled >= len(r.cache.pages) * ps]
    for needy in boundary[core.cache.available_pages:]:
        younger = [r for r in live[live.index(needy) + 1:] if r.state in (State.PREFILLING, State.DECODING)]
        if younger:
            return younger[-1].rid
    return None


def test_retraction_takes_the_policys_victim_and_changes_no_answer(tiny_models):
    """Four rows grow past a pool that holds about three of them. Each retraction must
    take the row the policy names (not the youngest by arrival, not the row asking), and
    every output must equal its solo run (retracted rows resume from the cache)."""
    model = tiny_models["llama"]
    ps = _prompts(4, seed=12)
    max_tokens = 40
    solo = _solo(model, ps, max_tokens)
    eng = LocalEngine(model, num_pages=26, page_size=4, max_rows=4, overlap=False)
    retracted: list[str] = []
    real = eng.core.retract
    eng.core.retract = lambda req: (retracted.append(req.rid), real(req))[1]
    try:
        rids = [eng.submit(p, max_tokens, ignore_eos=True) for p in ps]
        checked = 0
        for _ in range(2000):
            if eng.core.idle and not eng.queue:
                break
            expect, before = _policy_victim(eng.core), len(retracted)
            eng.step()  # a plan that only retracts builds no batch: the next turn goes on
            got = retracted[before:]
            if got or expect is not None:
                assert got == [expect], f"retracted {got}, the policy names {expect}"
                checked += 1
        assert checked, "the pool was never exhausted: this test proved nothing"
        for i, rid in enumerate(rids):
            assert eng.outputs[rid] == solo[i], f"request {i} changed by retraction"
    finally:
        eng.close()


def _target_logits(eng: LocalEngine, target: list[int], others: list[list[int]]) -> list[torch.Tensor]:
    for o in others:
        eng.submit(o, 2, ignore_eos=True)
    rid = eng.submit(target, 2, ignore_eos=True)  # last: the batch's tail rows are where tiles differ
    eng.run_to_idle()
    return eng.sample_logits[rid]


def test_deterministic_mode_gives_the_same_bits_at_every_batch_size_from_1_to_64(tiny_models):
    """One prompt decoded in batches of exactly 1..64 rows (every other row another
    prompt, all admitted in one step): its logits must be bit-identical at every size
    under --deterministic. Default mode must differ at some size, or the comparison
    could not fail."""
    model = tiny_models["llama"]
    target = list(range(40, 48))
    pool = _prompts(63, seed=13, lo=2, hi=5)  # short: the batch's row count is what varies

    def run(deterministic: bool, sizes) -> dict[int, list[torch.Tensor]]:
        eng = LocalEngine(model, num_pages=64 * 4, page_size=4, max_rows=64, max_batch_tokens=512, radix=False,
                          deterministic=deterministic)
        try:
            out = {}
            for b in sizes:
                out[b] = _target_logits(eng, target, pool[:b - 1])
                assert max(len(x.steps) for x in eng.batches[-2:]) == b, f"batch size {b} was not reached"
            return out
        finally:
            eng.close()

    det = run(True, range(1, 65))
    for b, logits in det.items():
        for k, (x, y) in enumerate(zip(logits, det[1])):
            assert torch.equal(x, y), f"batch of {b}: sample {k} differs from the batch of one"
    default = run(False, (1, 2, 9, 10, 11))
    assert any(not torch.equal(x, y) for b in default for x, y in zip(default[b], default[1])), \
        "default mode gave identical bits at every size: this test could not fail"
