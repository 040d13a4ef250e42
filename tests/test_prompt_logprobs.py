"""Prompt logprobs: `echo: true` + `logprobs: k` on /v1/completions, through a real server.

Oracle: transformers' AutoModelForCausalLM on the same float32 tiny checkpoint; the
logprob of prompt token p is log_softmax(logits at p - 1)[token p], and its top-k are
the k largest of that row. The server runs with a small --max-batch-tokens so the
prompt is prefilled in several chunks (each must contribute its positions in order),
and the request is asked twice: the second time its prefix is in the radix cache,
which it must not adopt (a cached page holds KV, not the logits it needs).
"""
from __future__ import annotations

import pytest
import requests
import torch

from serverproc import ServerProcess, stream_lines

transformers = pytest.importorskip("transformers")
TOP = 3
PROMPT = [(7 * i * i + 13 * i + 5) % 900 + 20 for i in range(45)]  # 45 tokens: 3+ chunks of 16


@pytest.fixture(scope="module")
def hf_logprobs(tiny_models) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["llama"], torch_dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(m(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def srv(tiny_models):
    s = ServerProcess(tiny_models["llama"], "--page-size", "4", "--kv-pages", "512",
                      "--max-batch-tokens", "16")
    yield s
    s.stop()
    assert not s.leftovers()


def complete(srv, stream: bool = False, **extra) -> requests.Response:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": stream, **extra}
    return requests.post(srv.url + "/v1/completions", json=body, headers=srv.headers,
                         timeout=120, stream=stream)


def assert_matches_transformers(lp: dict, hf: torch.Tensor) -> None:
    n = len(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == n + 2  # every prompt token, then the 2 generated
    for p in range(1, n):
        want = hf[p - 1]
        assert abs(lp["token_logprobs"][p] - want[PROMPT[p]].item()) < 1e-4, p
        # Keyed by token text: two partial-UTF-8 byte tokens may share a key ("\ufffd", the
        # later value kept), so each value must be one of transformers' top-k; all of them
        # when no key collided.
        top = want.topk(TOP).values
        got = sorted(lp["top_logprobs"][p].values(), reverse=True)
        assert 1 <= len(got) <= TOP, p
        assert all((top - v).abs().min() < 1e-4 for v in got), p
        if len(got) == TOP:
            assert torch.allclose(torch.tensor(got), top, atol=1e-4), p
    # The first generated token (greedy) is predicted from the prompt's last position.
    assert abs(lp["token_logprobs"][n] - hf[n - 1].max().item()) < 1e-4
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_echoed_prompt_logprobs_equal_transformers_when_cold_and_when_the_prefix_is_cached(srv, hf_logprobs):
    """A chunked prefill that dropped or reordered a chunk's positions, or a warm request
    that adopted the cached prefix (so those positions were never computed: null or
    missing entries), fails the per-position comparison with transformers."""
    for attempt in ("cold", "cached"):
        r = complete(srv, echo=True, logprobs=TOP)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, attempt
        assert_matches_transformers(body["choices"][0]["logprobs"], hf_logprobs)
    # The prefix really was cached: an ordinary request with the same prompt adopts it.
    plain = complete(srv, logprobs=TOP).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(srv, hf_logprobs):
    """Streamed pieces concatenated must be the same list as the whole body: prompt
    entries first (from the first chunk), then the generated tokens'."""
    r = complete(srv, stream=True, echo=True, logprobs=TOP)
    assert r.status_code == 200, r.text
    merged: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in stream_lines(r):
        if ev == b"[DONE]" or not ev["choices"]:
            continue
        lp = ev["choices"][0]["logprobs"]
        for k in merged:
            merged[k].extend(lp[k])
    assert_matches_transformers(merged, hf_logprobs)


def test_logprobs_without_echo_report_only_generated_tokens(srv):
    """Prompt logprobs are asked for by echo alone: without it nothing of the prompt
    appears and the request may adopt the cached prefix."""
    r = complete(srv, logprobs=TOP)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 2
