"""Request validation: wrong fields are refused with a 400 that names them.

The oracle is the table itself: each bad body differs from a valid one in one
field, so the `param` in the error must be that field and nothing else.
"""
from __future__ import annotations

import pytest

from ferroxmp.frontend.openai import schemas
from ferroxmp.frontend.errors import ApiError

VOCAB = 1000
OK_COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 4}
OK_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

COMPLETION_CASES = [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"stop": 3}, "stop"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop_token_ids": [1, VOCAB]}, "stop_token_ids"),
    ({"seed": "x"}, "seed"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"stream": "true"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream_options": []}, "stream_options"),
    ({"prompt": None}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[1, 2], [VOCAB]]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"model": 7}, "model"),
    ({"user": 7}, "user"),
]


@pytest.mark.parametrize("change,param", COMPLETION_CASES, ids=[p + str(i) for i, (_, p) in enumerate(COMPLETION_CASES)])
def test_a_bad_completion_field_is_a_400_naming_it(change, param):
    """A client fixes its request from `param`; a wrong or missing name sends it hunting."""
    with pytest.raises(ApiError) as e:
        schemas.parse_completion({**OK_COMPLETION, **change}, VOCAB)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user"}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"tools": {}}, "tools"),
    ({"temperature": None, "top_p": "x"}, "top_p"),
]


@pytest.mark.parametrize("change,param", CHAT_CASES, ids=[p + str(i) for i, (_, p) in enumerate(CHAT_CASES)])
def test_a_bad_chat_field_is_a_400_naming_it(change, param):
    """Chat-only fields and per-message errors name the message index and field."""
    with pytest.raises(ApiError) as e:
        schemas.parse_chat({**OK_CHAT, **change}, VOCAB)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body,param", [
    ({}, "input_ids"),
    ({"input_ids": [1, -1]}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ({"input_ids": [1], "sampling_params": []}, "sampling_params"),
])
def test_a_bad_generate_field_is_a_400_naming_it(body, param):
    """The native endpoint's nested sampling params are named with their prefix."""
    with pytest.raises(ApiError) as e:
        schemas.parse_generate(body, VOCAB)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("change,param", [({"best_of": 3}, "best_of"), ({"whatever": {"x": 1}}, "whatever"),
                                          ({"suffix": "tail"}, "suffix")])
def test_unknown_and_unimplemented_fields_are_refused_not_ignored(change, param):
    """A field the server does not act on must not be accepted: the client would believe
    it took effect (best_of=3, a suffix) when it did not."""
    with pytest.raises(ApiError) as e:
        schemas.parse_completion({**OK_COMPLETION, **change}, VOCAB)
    assert e.value.status == 400 and e.value.param == param


def test_values_reach_sampling_params():
    """The values that are served arrive in SamplingParams unchanged (top_k -1 = off), and
    fields set to what asks for nothing (best_of 1, null) pass."""
    req = schemas.parse_completion({**OK_COMPLETION, "best_of": 1, "suffix": None, "temperature": 0,
                                    "top_k": -1, "stop": "END", "seed": 5, "logprobs": 2, "n": 2}, VOCAB)
    sp = req.sampling_for(prompt_len=3, max_model_len=64)
    assert (sp.temperature, sp.top_k, sp.seed, sp.logprobs, sp.max_tokens) == (0.0, 0, 5, 2, 4)
    assert req.stop == ["END"] and req.n == 2


def test_chat_defaults_to_the_rest_of_the_context_and_completions_to_16():
    """OpenAI's defaults; a default never produces a request the scheduler must refuse."""
    chat = schemas.parse_chat(OK_CHAT, VOCAB)
    assert chat.sampling_for(10, 64).max_tokens == 54
    comp = schemas.parse_completion({"prompt": "x"}, VOCAB)
    assert comp.sampling_for(10, 64).max_tokens == 16
    assert comp.sampling_for(60, 64).max_tokens == 4  # a default never makes a request unfit
    assert chat.sampling_for(10, 64, pool_tokens=32).max_tokens == 22  # ... not even a small pool


@pytest.mark.parametrize("prompt_len,max_tokens,param", [(64, None, "prompt"), (0, None, "prompt"),
                                                         (60, 5, "max_tokens")])
def test_a_request_that_can_never_fit_is_refused_before_it_is_sent(prompt_len, max_tokens, param):
    """Prompt alone fills the context, empty prompt, or prompt + max_tokens over it: 400
    naming the field to change, before the scheduler sees it."""
    req = schemas.parse_completion({"prompt": "x", "max_tokens": max_tokens}, VOCAB)
    with pytest.raises(ApiError) as e:
        req.sampling_for(prompt_len, 64)
    assert e.value.status == 400 and e.value.param == param


def test_chat_logprobs_become_top_n_and_prompts_accept_every_openai_form():
    """logprobs=true without top_logprobs still asks for the chosen token's logprob (0),
    and the four OpenAI prompt forms all become one list of prompts."""
    assert schemas.parse_chat({**OK_CHAT, "logprobs": True, "top_logprobs": 3}, VOCAB).sampling.logprobs == 3
    assert schemas.parse_chat({**OK_CHAT, "logprobs": True}, VOCAB).sampling.logprobs == 0
    assert schemas.parse_chat(OK_CHAT, VOCAB).sampling.logprobs is None
    forms = {"s": "a", "ids": [1, 2], "strs": ["a", "b"], "idss": [[1], [2, 3]]}
    got = {k: schemas.parse_completion({"prompt": v}, VOCAB).prompts for k, v in forms.items()}
    assert got == {"s": ["a"], "ids": [[1, 2]], "strs": ["a", "b"], "idss": [[1], [2, 3]]}
