"""--speculative-ngram (issue 29): prompt-lookup drafts verified in one step.

The oracle is the same engine without speculation: greedy output must be identical —
through the prefix cache, chunked prefill, stop tokens, max_tokens, a grammar row beside
speculating rows, and bit for bit in --deterministic. Some draft must be accepted in
each comparison, or it proved nothing. Then a real server with the flag against one
without, and its counters in /metrics.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine import LocalEngine
from ferroxmp.gpu_worker.sampling.ngram import MAX_SKIP, Backoff, propose
from ferroxmp.protocol import Grammar
from serverproc import greedy_completion, metric, serving


def test_propose_continues_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest of two matches
    assert propose([5, 6, 4, 1, 2, 7, 7, 6, 2, 1, 2], 3) == [7, 7, 6]  # 2-gram "1 2" (no 3-gram matches)
    assert propose([4, 1, 2, 3], 4) == []  # nothing earlier matches its last 2 tokens
    assert propose([1, 2, 3, 1, 2], 8) == [3, 1, 2, 3, 1, 2, 3, 1]  # the period-3 cycle, on to k
    assert propose([7, 5, 5, 5], 4) == [5, 5, 5, 5]  # a one-token loop: k of it, not one
    assert propose([9, 1, 2, 3, 4, 1, 2], 2) == [3, 4]  # a cycle longer than k: its next k
    assert propose([1, 2], 4) == []


def test_backoff_skips_more_steps_after_each_rejected_draft_and_resets_on_an_accept():
    b = Backoff()
    skipped = []
    for _ in range(6):
        assert b.wants_draft()
        b.verified(4, 0)
        n = 0
        while not b.wants_draft():
            n += 1
        skipped.append(n)
        b.skip = 0
    assert skipped == [1, 3, 7, 15, MAX_SKIP, MAX_SKIP]
    b.verified(4, 2)
    b.verified(4, 0)
    assert b.skip == 1, "an accepted token resets the back-off"


def _true_next(want: list[int], prompt: list[int]):
    """An oracle drafter: the next k tokens of a plain run's output `want`."""
    return lambda tokens, k: want[len(tokens) - len(prompt):][:k]


def _wrong_next(want: list[int], prompt: list[int]):
    """A drafter always wrong: the oracle's tokens, each moved by one."""
    return lambda tokens, k: [(t + 1) % 1000 for t in want[len(tokens) - len(prompt):][:k]]


def test_a_draft_is_twice_the_run_its_drafts_had_accepted_lately():
    b = Backoff()
    assert b.length == 8
    b.verified(8, 8)  # run (3.5 + 8) / 2
    assert b.length == 12
    b.verified(12, 12)
    assert b.length == 18  # the budget (--num-speculative-tokens, at most 16) caps it
    b.verified(15, 6)  # a long run cut short: still long (copying breaks, then resumes)
    assert b.length == 15
    for _ in range(3):
        b.verified(b.length, 1)
    assert b.length == 4  # drafts breaking after a token: short ones
    b.verified(4, 0)
    assert b.length == 2 and b.skip == 1  # nothing accepted: shorter, and a skipped step


def test_the_runner_drafts_the_length_the_row_earned(tiny_model, monkeypatch):
    """An oracle drafter (the plain run's own tokens) is accepted whole, so each draft may
    be longer, up to --num-speculative-tokens; a drafter that is always wrong gets shorter
    drafts (and skipped steps). The output is the plain run's either way."""
    from ferroxmp.gpu_worker import runner as runner_mod
    prompt = np.random.default_rng(6).integers(5, 300, 20).tolist()

    def run(drafter=None, asked=None):
        eng = LocalEngine(tiny_model, num_pages=128, page_size=4, max_batch_tokens=64,
                          spec_tokens=15 if drafter else 0)
        if drafter:
            def record(tokens, k):
                asked.append(k)
                return drafter(tokens, k)
            monkeypatch.setattr(runner_mod, "propose", record)
        try:
            return eng.generate(prompt, 60)
        finally:
            monkeypatch.undo()
            eng.close()

    want = run()
    asked: list[int] = []
    assert run(_true_next(want, prompt), asked) == want
    assert asked[:3] == [8, 12, 15], asked
    asked.clear()
    assert run(_wrong_next(want, prompt), asked) == want
    assert asked[:3] == [8, 4, 2], asked


def _prompts(model_out: list[int], rng) -> list[list[int]]:
    """Prompts that invite copying: a text and its continuation repeated, the same text
    twice, and an unrelated short one."""
    base = rng.integers(5, 300, 24).tolist()
    return [base + model_out + base, base * 2, rng.integers(5, 300, 13).tolist(), base[:5] * 6]


def _run(model: str, spec: int, deterministic: bool, chunk: int, stops=(), **sampling) -> tuple[list, tuple]:
    eng = LocalEngine(model, num_pages=256, page_size=4, max_batch_tokens=chunk, max_rows=8,
                      deterministic=deterministic, spec_tokens=spec)
    try:
        rng = np.random.default_rng(3)
        first = eng.generate(rng.integers(5, 300, 24).tolist(), 12)
        prompts = _prompts(first, np.random.default_rng(3))
        outs = [eng.generate(p, 40, stop_token_ids=list(stops), **sampling) for p in prompts]
        outs.append(eng.generate(prompts[0], 40, **sampling))  # again: its prefix is cached now
        # Batched: every prompt at once, one of them under a grammar (never speculates).
        rids = [eng.submit(p, 30, stop_token_ids=list(stops), **sampling) for p in prompts]
        rids.append(eng.submit(prompts[1], 12, grammar=Grammar("regex", "[a-z ]{1,40}")))
        eng.run_until(lambda: all(r in eng.finish for r in rids))
        outs += [eng.outputs[r] for r in rids]
        outs.append([eng.finish[r] for r in rids])
        s = eng.core.stats()
        return outs, (s.spec_draft_tokens, s.spec_accepted_tokens)
    finally:
        eng.close()


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("chunk", [64, 5], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_output_is_identical_with_and_without_speculation(tiny_model, deterministic, chunk):
    plain, (drafted0, _) = _run(tiny_model, 0, deterministic, chunk)
    spec, (drafted, accepted) = _run(tiny_model, 4, deterministic, chunk)
    assert drafted0 == 0
    assert spec == plain
    assert accepted > 0, f"no draft was accepted ({drafted} drafted): the comparison proved nothing"


def test_seeded_sampled_output_is_identical_with_and_without_speculation(tiny_model):
    """With temperature the draw at a position is a Gumbel-max with noise fixed by (seed,
    position): verifying a draft with the row's own sampler accepts exactly the tokens
    it would have drawn, so the sampled output is the same sample, not only the same
    distribution. A low temperature keeps the random model's output copyable."""
    sampling = dict(temperature=0.1, top_k=3, seed=11)
    plain, _ = _run(tiny_model, 0, True, 64, **sampling)
    spec, (drafted, accepted) = _run(tiny_model, 4, True, 64, **sampling)
    assert spec == plain
    assert accepted > 0, f"no draft was accepted ({drafted} drafted)"
    greedy, _ = _run(tiny_model, 0, True, 64)
    assert greedy[:-1] != plain[:-1], "the sampled run must differ from greedy, or sampling was not tested"


def test_drafts_of_the_true_sample_are_all_accepted_at_temperature_one(tiny_model, monkeypatch):
    """Exactness of the verification under sampling: drafts that are the tokens the plain
    run drew (an oracle drafter) must all be accepted, and drafts that are wrong must all
    be rejected, and the output is the plain run's either way. (Verifying by argmax
    instead of the row's own draw would reject true tokens wherever the draw was not the
    argmax.)"""
    from ferroxmp.gpu_worker import runner as runner_mod
    prompt = np.random.default_rng(5).integers(5, 300, 20).tolist()
    params = dict(temperature=1.0, top_p=0.95, seed=7)

    def run(drafter=None):
        eng = LocalEngine(tiny_model, num_pages=128, page_size=4, spec_tokens=3 if drafter else 0)
        if drafter:
            monkeypatch.setattr(runner_mod, "propose", drafter)
        try:
            out = eng.generate(prompt, 24, **params)
            s = eng.core.stats()
            return out, s.spec_draft_tokens, s.spec_accepted_tokens
        finally:
            monkeypatch.undo()
            eng.close()

    want, _, _ = run()
    got, drafted, accepted = run(_true_next(want, prompt))
    assert got == want
    assert drafted > 10 and accepted == drafted, (drafted, accepted)
    got, drafted, accepted = run(_wrong_next(want, prompt))
    assert got == want
    assert drafted > 0 and accepted == 0, (drafted, accepted)


def test_stop_tokens_end_a_speculative_row_where_they_end_a_plain_one(tiny_model):
    plain, _ = _run(tiny_model, 0, True, 64)
    stops = {t for out in plain[:4] for t in out[5:8]}  # tokens the outputs do produce
    plain, _ = _run(tiny_model, 0, True, 64, stops)
    spec, (_, accepted) = _run(tiny_model, 4, True, 64, stops)
    assert spec == plain
    assert any(r == "stop" for r in plain[-1]), "some batched row must end on a stop token"
    assert accepted > 0


def test_a_server_with_speculation_answers_as_one_without_and_counts_its_drafts(tiny_model):
    text = "the cat sat on the mat and the dog sat on the log; " * 3
    prompts = [text + "the cat", "def f(x):\n    return x + 1\n\ndef f(x):\n", "hello there"]
    with serving(tiny_model) as plain:
        want = [greedy_completion(plain, p, 48) for p in prompts]
    with serving(tiny_model, "--speculative-ngram", "--num-speculative-tokens", "3") as srv:
        got = [greedy_completion(srv, p, 48) for p in prompts]
        import time
        time.sleep(1.1)  # counters ride the scheduler's heartbeat
        drafted = metric(srv.url, "ferroxmp_spec_draft_tokens_total", srv.headers)
        accepted = metric(srv.url, "ferroxmp_spec_accepted_tokens_total", srv.headers)
    assert got == want
    assert drafted > 0 and 0 <= accepted <= drafted
