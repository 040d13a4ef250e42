"""Every error status of the whole server (`ferroxmp serve`), over raw HTTP.

Each case checks the status, OpenAI's error shape `{"error": {"message", "type",
"param", "code"}}` (JSON, never an HTML page or a traceback), the `param` named
when a field is at fault, and then that a normal request still succeeds: an
error must not poison a connection, a row slot or a page.

Two servers for the module: `limits` (a small pool, one row, a 1 s queue
timeout, a 64 KiB body limit) and `keyed` (an API key).
"""
from __future__ import annotations

import time

import pytest
import requests

from serverproc import ServerProcess, stream_lines, serving

pytestmark = pytest.mark.timeout(120)

KEY = "sekret-key"
MAX_MODEL_LEN = 4096
POOL_TOKENS = 512 * 4
BODY_LIMIT = 65536
LIMITS = ("--page-size", "4", "--kv-pages", "512", "--max-model-len", str(MAX_MODEL_LEN),
          "--max-running-requests", "1", "--queue-timeout", "1", "--max-body-bytes", str(BODY_LIMIT))
ANY = object()  # the error's param is not checked


@pytest.fixture(scope="module")
def limits(tiny_models):
    with serving(tiny_models["llama"], *LIMITS) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed(tiny_models):
    with serving(tiny_models["llama"], "--page-size", "4", "--kv-pages", "256", "--api-key", KEY) as srv:
        yield srv


def assert_error(r: requests.Response, status: int, param=ANY) -> dict:
    """The status, the exact OpenAI error shape, and nothing a browser or a debugger
    would show instead (an HTML page, a Python traceback)."""
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json"), r.headers["Content-Type"]
    assert "<html" not in r.text.lower() and "Traceback" not in r.text
    body = r.json()
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and len(err["message"]) > 10, err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] is None or isinstance(err["code"], str), err
    if param is not ANY:
        assert err["param"] == param, err
    return err


def still_serves(srv: ServerProcess, headers=None) -> None:
    r = requests.post(srv.url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": "llama", "prompt": "still fine?", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def running(srv: ServerProcess) -> float:
    for line in requests.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ferroxmp_requests_running "):
            return float(line.split()[1])
    raise AssertionError("no ferroxmp_requests_running in /metrics")


def wait_idle(srv: ServerProcess, timeout: float = 8.0) -> None:
    deadline = time.time() + timeout
    while running(srv) != 0:
        assert time.time() < deadline, "the server never became idle"
        time.sleep(0.2)


# ---- 400 ---------------------------------------------------------------------

BAD_FIELDS = [
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {"prompt": [5, 6, 10 ** 6]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
]


@pytest.mark.parametrize("path,body,param", BAD_FIELDS, ids=[c[2] for c in BAD_FIELDS])
def test_a_bad_field_is_a_400_naming_the_field(limits, path, body, param):
    """A client fixing its request needs to know which field was wrong, spelled as it
    sent it (nested fields dotted)."""
    r = requests.post(limits.url + path, json={"model": "llama", **body}, timeout=30)
    assert_error(r, 400, param)
    still_serves(limits)


@pytest.mark.parametrize("body", ["{bad json", "", "\xff\xfe not utf-8", "[1, 2"], ids=["broken", "empty",
                                                                                        "binary", "truncated"])
def test_a_body_that_is_not_json_is_a_400(limits, body):
    r = requests.post(limits.url + "/v1/completions", data=body.encode("latin-1"), timeout=30,
                      headers={"Content-Type": "application/json"})
    assert_error(r, 400)
    still_serves(limits)


def test_a_json_body_that_is_not_an_object_is_a_400(limits):
    r = requests.post(limits.url + "/v1/chat/completions", json=[1, 2, 3], timeout=30)
    assert_error(r, 400)
    still_serves(limits)


NEVER_FITS = [
    ({"prompt": [5] * (MAX_MODEL_LEN + 10), "max_tokens": 1}, "prompt"),
    ({"prompt": "a short prompt", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body,param", NEVER_FITS, ids=["prompt-over-context", "prompt-plus-max-tokens"])
def test_a_request_beyond_max_model_len_is_a_400_at_once(limits, body, param, stream):
    """Waiting cannot make it fit, so it must be refused now (not queued until the
    timeout), with its own status even when streaming was asked for."""
    t0 = time.time()
    r = requests.post(limits.url + "/v1/completions", json={"model": "llama", "stream": stream, **body},
                      timeout=30)
    assert_error(r, 400, param)
    assert time.time() - t0 < 5
    still_serves(limits)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_beyond_the_whole_kv_pool_is_a_400_at_once(limits, stream):
    """Within the context but larger than every page of the pool together: the
    scheduler refuses it, and that refusal reaches the client as a 400, not a hang
    or a 503 after the queue timeout."""
    t0 = time.time()
    r = requests.post(limits.url + "/v1/completions", timeout=30, json={
        "model": "llama", "prompt": "a short prompt", "max_tokens": POOL_TOKENS + 100, "stream": stream})
    err = assert_error(r, 400)
    assert "pool" in err["message"] or "pages" in err["message"], err
    assert time.time() - t0 < 5
    still_serves(limits)


# ---- 401 ---------------------------------------------------------------------

@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", KEY, "Basic " + KEY, "Bearer " + KEY + "x"],
                         ids=["missing", "wrong", "no-scheme", "basic", "prefix-match"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models", "/generate"])
def test_a_missing_or_wrong_api_key_is_a_401(keyed, auth, path):
    """Every guarded endpoint refuses without the exact bearer key, and the same
    client then succeeds with it."""
    headers = {} if auth is None else {"Authorization": auth}
    body = {"input_ids": [5, 6], "sampling_params": {"max_tokens": 2}} if path == "/generate" else \
        {"model": "llama", "prompt": "hi", "max_tokens": 2}
    r = (requests.get if path == "/v1/models" else requests.post)(keyed.url + path, json=body, headers=headers,
                                                                  timeout=30)
    err = assert_error(r, 401)
    assert KEY not in r.text and err["type"] == "authentication_error"
    still_serves(keyed, headers={"Authorization": f"Bearer {KEY}"})


def test_health_needs_no_api_key_and_metrics_does(keyed):
    """Load balancers probe without credentials; /metrics (counts, queue sizes) needs the
    key unless --metrics-public (see test_validation.py)."""
    assert requests.get(keyed.url + "/health", timeout=10).status_code == 200
    assert_error(requests.get(keyed.url + "/metrics", timeout=10), 401)
    assert requests.get(keyed.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=10).status_code == 200


# ---- 404, 405, 413 -----------------------------------------------------------

def test_an_unknown_model_is_a_404_naming_the_model(limits):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = requests.post(limits.url + path, json={"model": "gpt-17", **body}, timeout=30)
        err = assert_error(r, 404, "model")
        assert "gpt-17" in err["message"]
    still_serves(limits)


@pytest.mark.parametrize("method,path", [("GET", "/v1/nothing"), ("POST", "/v1/engines/llama/completions"),
                                         ("GET", "/static/nothing.js"), ("GET", "/v1/completions/../../etc/passwd")])
def test_an_unknown_path_is_a_404(limits, method, path):
    r = requests.request(method, limits.url + path, json={}, timeout=30)
    assert_error(r, 404)
    still_serves(limits)


@pytest.mark.parametrize("method,path", [("GET", "/v1/completions"), ("GET", "/v1/chat/completions"),
                                         ("PUT", "/generate"), ("POST", "/v1/models"), ("DELETE", "/health")])
def test_a_wrong_method_is_a_405(limits, method, path):
    r = requests.request(method, limits.url + path, timeout=30)
    assert_error(r, 405)
    still_serves(limits)


def test_a_body_over_max_body_bytes_is_a_413(limits):
    """Refused before it is parsed (a huge prompt must not cost tokenization), also
    when the client streams it without a Content-Length."""
    big = ('{"model": "llama", "prompt": "' + "x " * BODY_LIMIT + '"}').encode()
    r = requests.post(limits.url + "/v1/completions", data=big, timeout=30,
                      headers={"Content-Type": "application/json"})
    assert_error(r, 413)
    r = requests.post(limits.url + "/v1/completions", data=iter([big[:40000], big[40000:]]), timeout=30,
                      headers={"Content-Type": "application/json"})
    assert_error(r, 413)
    still_serves(limits)


# ---- 503 ---------------------------------------------------------------------

def test_a_request_that_waits_past_the_queue_timeout_is_a_503(limits):
    """With one row held by a long request, the next waits --queue-timeout (1 s) and
    then gets a 503 — not sooner (it was admissible, only not now), not never. After
    the holder disconnects the row comes back and requests succeed again."""
    wait_idle(limits)
    hold = requests.post(limits.url + "/v1/completions", stream=True, timeout=30, json={
        "model": "llama", "prompt": "hold the only row", "max_tokens": POOL_TOKENS - 16, "ignore_eos": True,
        "stream": True})
    try:
        assert hold.status_code == 200
        events = stream_lines(hold)
        assert isinstance(next(events), dict)
        for stream in (False, True):
            t0 = time.time()
            r = requests.post(limits.url + "/v1/completions", timeout=30, json={
                "model": "llama", "prompt": "let me in", "max_tokens": 4, "stream": stream})
            waited = time.time() - t0
            assert_error(r, 503)
            assert 0.9 <= waited < 10, waited
        assert running(limits) == 1, "the holder finished early: the 503 proves nothing"
    finally:
        hold.close()
    wait_idle(limits)
    still_serves(limits)
