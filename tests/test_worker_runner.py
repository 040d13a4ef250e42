"""ModelRunner against transformers and against itself: greedy tokens equal HF generate,
chunking, batching and adopted prefixes do not change the answer, sliding-window rows
never read outside their window, and a bad batch changes nothing.

The oracles are transformers' generate (greedy, EOS not suppressed) and the runner's own
cold, unchunked, alone run, whose equality with transformers is pinned by the first test.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ferroxmp.protocol import RowStep, SamplingParams, unpack_ids
from ferroxmp.tiny_model import TINY_SHAPES

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0.0)


def prompt_of(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(1000 * n + seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    cache = {}

    def get(shape):
        if shape not in cache:
            m = transformers.AutoModelForCausalLM.from_pretrained(tiny_models[shape])
            m.generation_config.eos_token_id = None  # the worker never stops on its own
            cache[shape] = m
        return cache[shape]
    return get


@pytest.mark.parametrize("n", [1, 7, 100, 300])
@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_greedy_tokens_equal_transformers_generate(shape, n, tiny_models, hf_models, make_harness):
    """32 greedy tokens after prompts of 1, 7, 100 and 300 tokens (300 > Mistral's window
    of 64, and > several pages) must be transformers' exactly: any error in RoPE, norms,
    biases, GQA, the paged KV or the window shows up as a different token."""
    h = make_harness(tiny_models[shape])
    prompt = prompt_of(n, h.runner.config.vocab_size)
    out, _ = h.generate({0: prompt}, 32)
    ref = hf_models(shape).generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                    pad_token_id=0)[0, n:].tolist()
    assert out[0] == ref


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_chunked_prefill_gives_the_same_tokens_and_logits(shape, tiny_models, make_harness):
    """Chunks of 1, 3, 7 tokens and the whole prompt must give the same greedy tokens and
    first-token logits within 1e-5: RoPE must continue from each chunk's start and each
    chunk must attend over the KV earlier chunks wrote."""
    h = make_harness(tiny_models[shape])
    prompt = prompt_of(100, h.runner.config.vocab_size)
    whole, whole_logits = h.generate({0: prompt}, 12)
    for chunk in (1, 3, 7):
        out, logits = h.generate({1: prompt}, 12, chunk=chunk)
        assert out[1] == whole[0], f"chunk={chunk}"
        diff = max((a - b).abs().max().item() for a, b in zip(logits[1], whole_logits[0]))
        assert diff < 1e-5, f"chunk={chunk}: logits differ by {diff}"


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_a_row_gives_the_same_tokens_alone_and_in_a_mixed_batch(shape, tiny_models, make_harness):
    """Row 0 decodes while other rows of other lengths prefill in chunks and decode in
    the same steps: its tokens must equal its tokens alone (padding, masks and the
    internal reordering of steps must not leak between rows)."""
    h = make_harness(tiny_models[shape])
    vocab = h.runner.config.vocab_size
    prompts = {0: prompt_of(40, vocab), 1: prompt_of(130, vocab, 1), 2: prompt_of(5, vocab, 2),
               3: prompt_of(77, vocab, 3)}
    alone = {r: h.generate({r: p}, 16)[0][r] for r, p in prompts.items()}
    together, _ = h.generate(prompts, 16, chunk=24)
    assert together == alone


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_a_row_starting_from_adopted_pages_matches_a_cold_row(shape, tiny_models, make_harness):
    """Row 1 adopts row 0's first 3 pages (48 positions) and prefills only the rest,
    positions starting at 48. Its first logits must be bit-identical to the cold row's
    (same kernels: fp32 matmul rows do not depend on the batch when M > 1, and the
    rest of the prompt is long), and its 16 greedy tokens equal. With only 3 tokens
    left to prefill the small-M GEMM path differs: tokens equal, logits within 1e-5."""
    h = make_harness(tiny_models[shape])
    vocab = h.runner.config.vocab_size
    for n, adopted_pages in ((120, 3), (51, 3)):
        prompt = prompt_of(n, vocab)
        cold, cold_logits = h.generate({0: prompt}, 16)
        h.own_pages(1, prefix=tuple(h.pool.row_pages(0)[:adopted_pages]))
        warm, warm_logits = h.generate({1: prompt}, 16, starts={1: adopted_pages * h.page_size})
        assert warm[1] == cold[0]
        diff = max((a - b).abs().max().item() for a, b in zip(warm_logits[1], cold_logits[0]))
        assert diff < 1e-5
        if n - adopted_pages * h.page_size >= 16:
            assert torch.equal(warm_logits[1][0], cold_logits[0][0])
        h.own_pages(1)


def test_a_sliding_window_row_never_reads_pages_outside_its_window(tiny_models, make_harness):
    """Mistral (window 64): after a 300-token prompt, pages wholly outside every future
    query's window are set to -1 in the table and their KV poisoned with NaN. Decoding
    must continue with exactly the tokens of an untouched row: reading such a page
    would either fail the batch or spread NaN."""
    h = make_harness(tiny_models["mistral"])
    prompt = prompt_of(300, h.runner.config.vocab_size)
    ref, _ = h.generate({0: prompt}, 20)
    out, _ = h.generate({1: prompt}, 1)
    ps, window = h.page_size, h.runner.config.sliding_window
    dead = (300 - window + 1) // ps  # pages below this index hold no visible position
    assert dead >= 10
    for i in range(dead):
        page = int(h.pool.page_table[1, i])
        h.runner.kv.fill_page(page, float("nan"))
        h.pool.page_table[1, i] = -1
    toks = list(out[1])
    for _ in range(19):
        known = 300 + len(toks)
        res = h.run(steps=[RowStep(1, known - 1, 1, True)])
        assert res.error is None, res.error
        toks.append(int(unpack_ids(res.tokens)[0]))
    assert toks == ref[0]


def test_a_prefill_chunk_that_does_not_end_the_prompt_samples_nothing(tiny_models, make_harness):
    """sample=False must return no row and no token, and the row's tokens stay the prompt."""
    h = make_harness(tiny_models["qwen3"])
    prompt = prompt_of(20, h.runner.config.vocab_size)
    res = h.run([h.new_row(0, prompt)], [RowStep(0, 0, 10, False)])
    assert res.error is None and res.rows == b"" and res.tokens == b""
    assert h.runner.row_tokens(0) == prompt


def test_bad_batches_get_an_error_and_change_nothing(tiny_models, make_harness):
    """Each malformed batch must come back with `error` set, leave every row's tokens as
    they were, and the runner must then produce exactly the reference tokens."""
    h = make_harness(tiny_models["llama"])
    vocab = h.runner.config.vocab_size
    prompt = prompt_of(30, vocab)
    ref, _ = h.generate({0: prompt}, 6)
    res = h.run([h.new_row(1, prompt)], [RowStep(1, 0, 30, True)])
    first = int(unpack_ids(res.tokens)[0])
    before = h.runner.row_tokens(1)
    h.pool.page_table[2, 1] = -1
    h.pool.page_table[3, 0] = h.pool.num_pages + 5
    bad = [
        ([], [RowStep(7, 0, 1, True)]),  # row never started
        ([], [RowStep(1, 30, 5, True)]),  # beyond the known tokens
        ([], [RowStep(1, 0, 10, True)]),  # sampling step that does not end at the last token
        ([], [RowStep(1, 30, 1, True), RowStep(1, 30, 1, True)]),  # one row twice
        ([h.new_row(2, prompt)], [RowStep(2, 0, 30, True)]),  # page -1 where it must write
        ([h.new_row(3, prompt)], [RowStep(1, 30, 1, True), RowStep(3, 0, 30, True)]),  # page out of range
        ([h.new_row(4, [1, vocab + 3])], [RowStep(4, 0, 2, True)]),  # token outside the vocabulary
        ([h.new_row(99, prompt)], []),  # not a row slot
        ([h.new_row(5, [])], []),  # no tokens
    ]
    for new_rows, steps in bad:
        res = h.run(new_rows, steps)
        assert res.error, (new_rows, steps)
        assert res.rows == b"" and res.tokens == b""
        assert h.runner.row_tokens(1) == before
        assert set(h.runner.rows) == {0, 1}
    toks = [first]
    for i in range(5):
        res = h.run(steps=[RowStep(1, 30 + i, 1, True)])
        assert res.error is None
        toks.append(int(unpack_ids(res.tokens)[0]))
    assert toks == ref[0]


def test_a_retracted_row_resent_with_its_tokens_continues_the_same(tiny_models, make_harness):
    """After a retraction the scheduler re-sends prompt + generated tokens as a NewRow
    and prefills them: the continuation must be the tokens the row would have made."""
    h = make_harness(tiny_models["qwen2"])
    prompt = prompt_of(25, h.runner.config.vocab_size)
    ref, _ = h.generate({0: prompt}, 20)
    resent = prompt + ref[0][:8]
    out, _ = h.generate({2: resent}, 12, chunk=16)
    assert out[2] == ref[0][8:]


def test_logprobs_come_from_the_raw_logits(tiny_models, make_harness):
    """The chosen token's logprob and the top-n must be log_softmax of the model's raw
    logits (not the penalised or temperature-scaled ones), top-n sorted, n capped at 20."""
    h = make_harness(tiny_models["llama"])
    prompt = prompt_of(12, h.runner.config.vocab_size)
    params = SamplingParams(temperature=0.7, logprobs=50, repetition_penalty=1.3)
    res = h.run([h.new_row(0, prompt, params, seed=3), h.new_row(1, prompt)],
                [RowStep(0, 0, 12, True), RowStep(1, 0, 12, True)])
    assert set(res.logprobs) == {0}
    lp = res.logprobs[0]
    ref = torch.log_softmax(h.runner.last_logits[0].double(), dim=-1)
    chosen = int(unpack_ids(res.tokens)[0])
    assert abs(lp.token_logprob - ref[chosen].item()) < 1e-5
    assert len(lp.top_ids) == 20 and lp.top_ids == ref.topk(20).indices.tolist()
    assert np.allclose(lp.top_logprobs, ref.topk(20).values.numpy(), atol=1e-5)
