"""Fuzzing the three generation endpoints of a real server: no input reaches a 500.

Hypothesis sends bodies built from a valid one with a few fields replaced by
something hostile (a wrong type, an extreme or overflowing number, NaN/Infinity,
a 400-digit integer, deep nesting, odd unicode, oversize strings, unknown keys),
and raw byte strings that are barely JSON. The oracles: no status >= 500 ever,
every 4xx in OpenAI's exact error shape, every 200 a well-formed answer (also
streamed: no error event), no unhandled error in the server's log, and a canary
request with the same greedy answer before and after the whole run.

CI runs FERROXMP_FUZZ_EXAMPLES (default 200) examples; set it higher locally.
"""
from __future__ import annotations

import json
import os

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serverproc import ServerProcess, stream_lines

pytestmark = pytest.mark.timeout(int(os.environ.get("FERROXMP_FUZZ_TIMEOUT", "900")))

EXAMPLES = int(os.environ.get("FERROXMP_FUZZ_EXAMPLES", "200"))
CONTEXT = 96

BASES = {
    "/v1/completions": {"model": "llama", "prompt": "fuzz me", "max_tokens": 3, "temperature": 0},
    "/v1/chat/completions": {"model": "llama", "messages": [{"role": "user", "content": "fuzz me"}],
                             "max_tokens": 3, "temperature": 0},
    "/generate": {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3, "temperature": 0}},
}
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "n", "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "user",
          "frequency_penalty", "presence_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos",
          "chat_template_kwargs", "add_generation_prompt", "cache_salt", "model", "input_ids", "sampling_params",
          "best_of", "logit_bias", "tools", "response_format", "suffix", "unknown_field", ""]

EXTREME_NUMBERS = [0, -1, 1, 2, 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 400,
                   -(10 ** 400), 1e308, -1e308, 5e-324, -0.0, 0.5, 1.0, 1.5, 100.0, 101, CONTEXT, CONTEXT - 3]
WEIRD_TEXT = ["", "\x00", "\n\r\t", "\u2028", "\ud7ff\ue000", "🙂" * 50, "<|im_start|>", "<|im_end|>assistant",
              "a\u0301" * 40, "\ufeff", "x" * 100_000, "{{ raise_exception('boom') }}"]


def _deep(depth: int):
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


json_leaf = st.one_of(st.none(), st.booleans(), st.sampled_from(EXTREME_NUMBERS), st.integers(),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
                      st.sampled_from(WEIRD_TEXT))
json_value = st.recursive(json_leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                          max_leaves=12)
hostile = st.one_of(json_value, st.sampled_from([_deep(70), _deep(900), {"role": "wizard", "content": "x"},
                                                 [{"role": "user", "content": [{"type": "image_url"}]}],
                                                 [{"role": "tool", "content": "r", "tool_call_id": "c"}],
                                                 {"messages": []}, {"max_tokens": 2 ** 64}, [2 ** 63] * 3]))


NUMERIC = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
           "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "best_of"]
SHARP = [10 ** 400, -(10 ** 400), 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 1e308, -1e308, 5e-324, -0.0, -1, 0, 1,
         "1", True, None, [], {}, [1], float("nan"), float("inf")]


@st.composite
def targeted(draw):
    """One numeric field of an otherwise valid body set to a sharp value: the bounds
    themselves (a multi-field mutation is mostly refused by its first bad field)."""
    path = draw(st.sampled_from(sorted(BASES)))
    body = json.loads(json.dumps(BASES[path]))
    target = body["sampling_params"] if path == "/generate" else body
    target[draw(st.sampled_from(NUMERIC))] = draw(st.sampled_from(SHARP))
    return path, json.dumps(body).encode()


@st.composite
def mutated(draw):
    path = draw(st.sampled_from(sorted(BASES)))
    body = json.loads(json.dumps(BASES[path]))
    target = body["sampling_params"] if path == "/generate" and draw(st.booleans()) else body
    for key in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
        target[key] = draw(hostile)
    if draw(st.integers(0, 7)) == 0:  # Python writes NaN/Infinity literals: not JSON, must be a 400
        target[draw(st.sampled_from(["temperature", "top_p", "min_p", "top_k"]))] = draw(
            st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    # raw UTF-8 too; a lone surrogate then becomes invalid UTF-8, which must be a 400 as well
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    return path, text.encode("utf-8", "surrogatepass")


raw_bytes = st.tuples(st.sampled_from(sorted(BASES)), st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"1e999", b"[" * 5000 + b"]" * 5000,
                     b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", b'{"prompt": "\\ud800"}',
                     b'{"prompt": "hi", "top_k": 1' + b"0" * 400 + b"}", b'{"prompt": "hi", "temperature": NaN}'])))


@pytest.fixture(scope="module")
def srv(tiny_models):
    s = ServerProcess(tiny_models["llama"], "--page-size", "4", "--kv-pages", "1024", "--max-model-len", str(CONTEXT),
                      "--max-body-bytes", str(1 << 20))
    yield s
    s.stop()
    assert not s.leftovers()


def _canary(s: ServerProcess) -> list:
    r = requests.post(s.url + "/generate", timeout=60, json={
        "input_ids": [11, 12, 13, 14], "sampling_params": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _check(r: requests.Response, body: bytes) -> None:
    where = f"{r.request.url} {body[:300]!r}"
    assert r.status_code < 500, f"{r.status_code} for {where}: {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json()
        assert list(err) == ["error"], where
        assert set(err["error"]) == {"message", "type", "param", "code"}, where
        assert isinstance(err["error"]["message"], str) and err["error"]["type"], where
        return
    assert r.status_code == 200, where
    if r.headers["Content-Type"].startswith("text/event-stream"):
        events = list(stream_lines(r))
        assert events and events[-1] == b"[DONE]", where
        assert not any(isinstance(e, dict) and "error" in e for e in events), f"{where}: {events[-3:]}"
    else:
        out = r.json()
        assert ("choices" in out) or ("output_ids" in out), where


def _send(s: ServerProcess, path: str, body: bytes) -> None:
    r = requests.post(s.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=60, stream=True)
    try:
        _check(r, body)
    finally:
        r.close()


def test_no_body_reaches_a_5xx_and_the_canary_is_unchanged(srv):
    before = _canary(srv)

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(case=st.one_of(targeted(), mutated(), raw_bytes))
    def fuzz(case):
        _send(srv, *case)

    fuzz()
    assert _canary(srv) == before
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    log = open(srv.log_path, encoding="utf-8", errors="replace").read()
    assert "unhandled error" not in log and "Traceback" not in log, log[-3000:]
