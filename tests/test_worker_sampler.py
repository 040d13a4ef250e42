"""The sampler: seeded draws reproduce whatever shares the batch and across a retraction,
filters keep exactly the right candidates, the draw follows the softmax, and penalties
follow transformers (repetition) and OpenAI (frequency/presence).

Oracles: transformers' RepetitionPenaltyLogitsProcessor, the softmax itself (empirical
frequencies), and the closed-form candidate sets of top-k / top-p / min-p.
"""
from __future__ import annotations

import math

import pytest
import torch

from ferroxmp.gpu_worker.sampling.sampler import RowSample, apply_penalties, argmax, gumbel_noise, sample
from ferroxmp.protocol import SamplingParams

transformers = pytest.importorskip("transformers")


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n draws from one row of logits at positions 0..n-1 (one batch of n rows)."""
    rows = [RowSample(params, seed, pos) for pos in range(n)]
    return sample(logits.expand(n, -1).contiguous(), rows).tolist()


def test_gumbel_noise_is_a_pure_function_of_seed_position_and_token():
    """Reproducibility rests on this: same (seed, position) same noise whatever the row's
    place in the batch; another seed or position gives other noise; all finite."""
    a = gumbel_noise([5, 9, 5], [10, 10, 11], 300, torch.device("cpu"))
    b = gumbel_noise([9, 5], [10, 10], 300, torch.device("cpu"))
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    assert torch.isfinite(a).all()
    big = gumbel_noise([2**70 + 3, -1], [0, 2**40], 8, torch.device("cpu"))  # any Python int seed
    assert torch.isfinite(big).all()


def test_the_draw_follows_the_softmax():
    """4,000 draws at temperature 0.5 over 5 tokens: each token's frequency must be within
    5 standard errors of softmax(logits / 0.5) (a biased noise would fail this)."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -3.0]])
    n = 4000
    got = torch.bincount(torch.tensor(draws(logits, SamplingParams(temperature=0.5), n, seed=1)), minlength=5)
    want = torch.softmax(logits[0] / 0.5, dim=-1)
    for i in range(5):
        se = math.sqrt(want[i] * (1 - want[i]) / n) + 1e-3
        assert abs(got[i].item() / n - want[i].item()) < 5 * se, (i, got.tolist(), want.tolist())


def test_top_k_top_p_and_min_p_keep_exactly_their_candidates():
    """Over many draws the set of sampled tokens must equal the closed-form candidate set:
    top-k the k best; top-p the smallest prefix of the sorted probs reaching p; min-p
    those with prob >= min_p * max prob."""
    logits = torch.tensor([[3.0, 2.9, 2.8, 1.0, 0.9, -1.0, -2.0, -5.0]])
    p = torch.softmax(logits[0], dim=-1)
    assert set(draws(logits, SamplingParams(top_k=3), 600)) == {0, 1, 2}
    cum = torch.cumsum(p, 0)
    nucleus = int((cum < 0.9).sum()) + 1
    assert set(draws(logits, SamplingParams(top_p=0.9), 600)) == set(range(nucleus))
    keep = {i for i in range(8) if p[i] >= 0.1 * p.max()}
    assert set(draws(logits, SamplingParams(min_p=0.1), 600)) == keep
    assert draws(logits, SamplingParams(top_p=1e-6), 50) == [0] * 50


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_argmax_picks_what_torch_picks_ties_nan_and_strided_rows_included(dtype):
    """The CPU argmax (numpy's) against torch's own: the first of equal maxima, a NaN as
    the largest, rows of a strided view, an inference tensor."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4099, generator=g, dtype=dtype)
    x[1, 7] = x[1, 4000] = float("nan")
    x[2, 3] = x[2, 9] = x[2, 4098] = 1e3
    x[3] = 0.0
    x[4, -1] = float("inf")
    for t in (x, x[:, ::3], x[::2]):
        want = t.argmax(dim=-1).tolist()
        with torch.inference_mode():
            inference = argmax(t.clone())
        got = argmax(t)  # the strided view itself
        assert got.dtype == inference.dtype == torch.int64 and got.tolist() == inference.tolist() == want


def test_top_k_1_and_temperature_0_are_greedy():
    """Both must be argmax exactly, whatever the seed."""
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    rows = [RowSample(SamplingParams(top_k=1, temperature=1.5), seed=s, position=s) for s in range(16)]
    assert torch.equal(sample(logits, rows), logits.argmax(-1))
    rows = [RowSample(SamplingParams(temperature=0.0), seed=s, position=s) for s in range(16)]
    assert torch.equal(sample(logits, rows), logits.argmax(-1))


def test_repetition_penalty_matches_transformers():
    """HF semantics over prompt + generated: positive logits divided, negative multiplied."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    tokens = [[1, 4, 4, 9, 30], [2, 3]]
    rows = [RowSample(SamplingParams(repetition_penalty=1.7), 0, len(t), t, 2) for t in tokens]
    got = apply_penalties(logits, rows)
    proc = transformers.RepetitionPenaltyLogitsProcessor(penalty=1.7)
    for i, t in enumerate(tokens):
        want = proc(torch.tensor([t]), logits[i:i + 1].clone())[0]
        assert torch.allclose(got[i], want)


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    """OpenAI semantics: logit -= frequency * count + presence * (count > 0), counted over
    generated tokens; prompt tokens are untouched; untouched rows keep their logits."""
    logits = torch.zeros(2, 10)
    prompt, gen = [7, 7, 8], [3, 3, 3, 5]
    rows = [RowSample(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), 0, 7, prompt + gen, 3),
            RowSample(SamplingParams(), 0, 7)]
    got = apply_penalties(logits, rows)
    want = torch.zeros(10)
    want[3] = -(0.5 * 3 + 0.25)
    want[5] = -(0.5 + 0.25)
    assert torch.equal(got[0], want)
    assert torch.equal(got[1], torch.zeros(10))


def test_penalties_change_a_greedy_choice():
    """A greedy row whose best token was already generated must switch to the runner-up
    under a presence penalty larger than the gap, and keep it without one."""
    logits = torch.tensor([[2.0, 1.8, 0.0]])
    base = RowSample(SamplingParams(temperature=0.0), 0, 3, [2, 0], 1)
    assert sample(logits, [base]).item() == 0
    pen = RowSample(SamplingParams(temperature=0.0, presence_penalty=0.5), 0, 3, [2, 0], 1)
    assert sample(logits, [pen]).item() == 1


# ---- through the runner -------------------------------------------------------------

def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_seeded_sampling_reproduces_alone_in_a_batch_and_after_a_retraction(tiny_models, make_harness):
    """Row 0 (seed 42, temperature 1, top-p 0.95) alone; then the same request in a batch
    with three rows of other prompts, params and seeds; then re-sent after 10 tokens as a
    retracted row would be. All three must give the same 24 tokens; another seed must not."""
    h = make_harness(tiny_models["qwen3"])
    vocab = h.runner.config.vocab_size
    p0 = _prompt(33, vocab, 0)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    alone, _ = h.generate({0: p0}, 24, params=params, seeds={0: 42})
    prompts = {0: p0, 1: _prompt(70, vocab, 1), 2: _prompt(9, vocab, 2), 3: _prompt(40, vocab, 3)}
    mixed = {0: params, 1: SamplingParams(temperature=0.8, top_k=20), 2: SamplingParams(temperature=0.0),
             3: SamplingParams(temperature=1.2, min_p=0.05, frequency_penalty=0.3)}
    together, _ = h.generate(prompts, 24, params=mixed, seeds={0: 42, 1: 42, 3: 7}, chunk=16)
    assert together[0] == alone[0]
    resent, _ = h.generate({5: p0 + alone[0][:10]}, 14, params=params, seeds={5: 42})
    assert resent[5] == alone[0][10:]
    other, _ = h.generate({6: p0}, 24, params=params, seeds={6: 43})
    assert other[6] != alone[0]
    assert len(set(alone[0])) > 4  # a sampled stream, not a stuck token


def test_top_k_1_through_the_runner_equals_greedy(tiny_models, make_harness):
    h = make_harness(tiny_models["mistral"])
    p = _prompt(90, h.runner.config.vocab_size, 5)
    greedy, _ = h.generate({0: p}, 16)
    topk1, _ = h.generate({1: p}, 16, params=SamplingParams(temperature=1.3, top_k=1), seeds={1: 9})
    assert topk1[1] == greedy[0]
