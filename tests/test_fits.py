"""One rule decides whether a request fits the context (issue 27): `fits.context_refusal`,
used by the frontend's 400s and the scheduler's refusal alike, with one message."""
from __future__ import annotations

import pytest

from ferroxmp.fits import context_refusal
from ferroxmp.frontend.openai import schemas
from ferroxmp.frontend.errors import ApiError
from ferroxmp.protocol import SamplingParams
from ferroxmp.scheduler.settings import SchedulerConfig

LIMIT = 64


def test_the_boundaries():
    assert context_refusal(LIMIT - 1, None, LIMIT) is None  # one completion token still fits
    assert "the prompt has 64 tokens" in context_refusal(LIMIT, None, LIMIT)
    assert context_refusal(40, 24, LIMIT) is None
    why = context_refusal(40, 25, LIMIT)
    assert "the prompt has 40 and max_tokens asks for 25 more" in why and "64 tokens" in why
    assert "at least 70 tokens" in context_refusal(70, None, LIMIT, at_least=True)


@pytest.mark.parametrize("prompt_len,max_tokens", [(40, 25), (64, 1), (63, 2)])
def test_the_frontend_and_the_scheduler_refuse_with_the_same_words(prompt_len, max_tokens):
    req = schemas.parse_completion({"prompt": [5] * prompt_len, "max_tokens": max_tokens}, 1000)
    with pytest.raises(ApiError) as err:
        req.sampling_for(prompt_len, LIMIT)
    cfg = SchedulerConfig(page_size=4, max_batch_tokens=64, max_model_len=LIMIT, vocab_size=1000)
    scheduler_says = cfg.refusal(SamplingParams(max_tokens=max_tokens), prompt_len, num_pages=1000)
    assert scheduler_says is not None and scheduler_says in err.value.message
    assert scheduler_says == context_refusal(prompt_len, max_tokens, LIMIT) or \
        scheduler_says == context_refusal(prompt_len, None, LIMIT)


def test_token_id_prompts_and_long_texts_are_refused_by_the_same_rule():
    with pytest.raises(ApiError) as err:
        schemas.parse_completion({"prompt": [5] * LIMIT}, 1000, LIMIT)
    assert context_refusal(LIMIT, None, LIMIT) in err.value.message
