"""logit_bias and min_tokens, in the worker and through the server.

Oracles: transformers' logits on the same checkpoint (the greedy token and the second
best), and the token ids the server returns on /generate.
"""
from __future__ import annotations

import pytest
import requests
import torch

from ferroxmp.protocol import SamplingParams
from serverproc import serving

transformers = pytest.importorskip("transformers")
PROMPT = [11, 250, 37, 4, 980, 61, 5]


@pytest.fixture(scope="module")
def hf_logits(tiny_models):
    m = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    with torch.no_grad():
        return m(torch.tensor([PROMPT])).logits[0, -1].float()


def test_a_plus_100_bias_makes_greedy_pick_that_token_every_step(tiny_model, make_harness, hf_logits):
    target = int(hf_logits.argsort()[len(hf_logits) // 2])  # a middling token, not the greedy one
    h = make_harness(tiny_model)
    out, _ = h.generate({0: PROMPT}, 6, SamplingParams(temperature=0.0, logit_bias={target: 100.0}))
    assert out[0] == [target] * 6


def test_a_minus_100_bias_on_the_greedy_token_gives_the_second_best(tiny_model, make_harness, hf_logits):
    """The bias is added to the raw logit of that token only: the next best by
    transformers' logits must win, nothing else moves."""
    best, second = hf_logits.topk(2).indices.tolist()
    h = make_harness(tiny_model)
    out, _ = h.generate({0: PROMPT}, 1, SamplingParams(temperature=0.0, logit_bias={best: -100.0}))
    assert out[0] == [second]


def test_biased_and_unbiased_rows_share_a_batch_without_leaking(tiny_model, make_harness, hf_logits):
    best = int(hf_logits.argmax())
    h = make_harness(tiny_model)
    out, _ = h.generate({0: PROMPT, 1: PROMPT}, 1, {0: SamplingParams(temperature=0.0, logit_bias={best: -100.0}),
                                                    1: SamplingParams(temperature=0.0)})
    assert out[1] == [best] and out[0] != [best]


def test_min_tokens_masks_eos_and_stop_ids_until_reached(tiny_model, make_harness):
    """EOS is forced by a +100 bias; min_tokens=5 must hold it (and a stop id, also forced)
    off for 5 tokens, then EOS comes at once."""
    h = make_harness(tiny_model)
    eos = h.runner.config.eos_token_ids
    stop = 77
    bias = {eos[0]: 100.0, stop: 99.0}
    out, _ = h.generate({0: PROMPT}, 7, SamplingParams(temperature=1.0, logit_bias=bias, min_tokens=5,
                                                       stop_token_ids=[stop]), seeds={0: 3})
    assert not set(out[0][:5]) & (set(eos) | {stop}), out[0]
    assert out[0][5] == eos[0]


# ---- through the server -----------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tiny_models):
    with serving(tiny_models["llama"], "--page-size", "4", "--kv-pages", "512") as s:
        yield s


def gen(srv, **sampling):
    return requests.post(srv.url + "/generate", json={"input_ids": PROMPT, "sampling_params": sampling},
                         headers=srv.headers, timeout=120)


def test_the_server_applies_logit_bias_and_min_tokens(srv, hf_logits, tiny_models):
    best, second = hf_logits.topk(2).indices.tolist()
    r = gen(srv, temperature=0, max_tokens=1, logit_bias={str(best): -100})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == [second]
    eos = transformers.AutoConfig.from_pretrained(tiny_models["llama"]).eos_token_id
    r = gen(srv, temperature=0, max_tokens=20, min_tokens=4, logit_bias={str(eos[0]): 100})
    assert r.status_code == 200, r.text
    ids = r.json()["output_ids"]
    # 4 tokens held off EOS, then the forced EOS, which ends the row (/generate returns it)
    assert r.json()["finish_reason"] == "stop" and ids[4:] == [eos[0]] and eos[0] not in ids[:4], ids


@pytest.mark.parametrize("sampling,param", [
    ({"logit_bias": {"5": 101}}, "sampling_params.logit_bias.5"),
    ({"logit_bias": {"abc": 1}}, "sampling_params.logit_bias.abc"),
    ({"logit_bias": {"100000": 1}}, "sampling_params.logit_bias.100000"),
    ({"logit_bias": [1, 2]}, "sampling_params.logit_bias"),
    ({"min_tokens": -1}, "sampling_params.min_tokens"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
])
def test_out_of_range_bias_and_min_tokens_are_a_400_naming_them(srv, sampling, param):
    r = gen(srv, **sampling)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
