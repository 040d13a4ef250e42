"""A step is bounded in time: the prefill budget follows the measured speed.

Measured before this: a 2,147-token prompt on an emulated-bf16 CPU was one step of
over 60 s (the whole chunk of --max-batch-tokens), during which no stream moved and
the watchdog killed the server. Oracles: a synthetic machine whose step time is a
known linear function of its tokens (so the right chunk size is known in closed
form), and the same prompts run unbounded, whose greedy tokens must not change.
"""
from __future__ import annotations

import msgspec
import pytest

from engine import LocalEngine
from ferroxmp.scheduler.step_budget import StepBudget

OVERHEAD_S, PER_TOKEN_S, TARGET_S = 0.01, 0.002, 0.3
SETTLED = int((TARGET_S - OVERHEAD_S) / PER_TOKEN_S)  # 145: the chunk that takes the target


def _machine_seconds(tokens: int) -> float:
    return OVERHEAD_S + PER_TOKEN_S * tokens


def test_the_budget_settles_where_a_step_takes_the_target_time():
    """Measuring at budget B gives B / (overhead + cost * B); the fixed point is the
    chunk that takes exactly the target. A budget computed from the ceiling, or a
    plain tokens/s of the latest step without the EWMA, would not land within 5%."""
    b = StepBudget(TARGET_S, ceiling=2048)
    assert b.step_tokens == 2048, "unmeasured: the ceiling (no bound before the first measurement)"
    for _ in range(40):
        n = b.step_tokens
        b.observe(n, _machine_seconds(n))
    assert abs(b.step_tokens - SETTLED) <= 0.05 * SETTLED, (b.step_tokens, SETTLED)


def test_decode_rows_are_never_cut_and_a_prefill_always_gets_the_floor():
    """With 500 decode rows on a machine that can do 145 tokens in the target, the
    step still holds every decode row (the budget only bounds prefill) and a waiting
    prompt still advances by `floor` tokens: neither streams nor prefill starve."""
    b = StepBudget(TARGET_S, ceiling=2048, floor=16)
    for _ in range(40):
        b.observe(b.step_tokens, _machine_seconds(b.step_tokens))
    assert b.prefill_allowance(0) == b.step_tokens
    assert b.prefill_allowance(100) == b.step_tokens - 100
    assert b.prefill_allowance(500) == 16
    off = StepBudget(0.0, ceiling=2048)
    off.observe(1000, 100.0)
    assert off.step_tokens == 2048, "--max-step-seconds 0 must leave the token bound alone"


def _engine(model: str, target: float) -> LocalEngine:
    eng = LocalEngine(model, num_pages=512, page_size=4, max_batch_tokens=1024, max_rows=4)
    eng.core.step_budget = StepBudget(target, ceiling=1024)
    real = eng.runner.execute

    def slow_machine(batch):  # the real forward, timed as the synthetic machine would be
        res = real(batch)
        return msgspec.structs.replace(res, compute_s=_machine_seconds(sum(s.length for s in batch.steps)))

    eng.runner.execute = slow_machine
    return eng


def test_chunks_shrink_to_the_target_and_greedy_output_equals_the_unbounded_run(tiny_models):
    """A 900-token prompt after a 400-token warm-up, on a machine doing ~145 tokens in
    the target: after the first measured step every step's synthetic time stays within
    25% of the target (the unbounded run does one 900-token step of 1.8 s), and both
    prompts' greedy tokens equal those of the same engine without the time bound, where
    each prompt is one chunk. Chunking must never change an answer."""
    prompts = [[(7 * i + 3) % 997 + 1 for i in range(400)], [(13 * i + 5) % 991 + 1 for i in range(900)]]
    answers = []
    for target in (0.0, TARGET_S):
        eng = _engine(tiny_models["llama"], target)
        try:
            answers.append([eng.generate(p, max_tokens=6) for p in prompts])
            sizes = [sum(s.length for s in b.steps) for b in eng.batches]
        finally:
            eng.close()
        if target == 0.0:
            assert max(sizes) >= 900, "the unbounded run must prefill each prompt in one step"
        else:
            assert max(sizes[1:]) <= 1.25 * SETTLED and max(sizes[1:]) >= 0.75 * SETTLED, sizes
            assert all(_machine_seconds(n) <= 1.25 * TARGET_S for n in sizes[1:]), sizes
    assert answers[0] == answers[1]
    assert all(len(a) == 6 for a in answers[0])
