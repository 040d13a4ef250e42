"""Validation at the edge, over raw HTTP against `ferroxmp serve` (and the pieces it uses).

What each test pins down: a bound that is not checked reaches the worker (a top_k of
2^63 failed a whole batch) or raises in the frontend (a 400-digit integer in a float
field, JSON 5,000 levels deep, `chat_template_kwargs` naming `messages`: all 500s);
a field that is accepted and ignored lies to the client; a prompt tokenized before
its size is checked stalls every other client; a newline in a client's string
forges a log line; an API key check that is case-sensitive in the scheme, or that
leaves /server_info and /metrics open. Oracles: the 400's `param` and the bound in
its message (from the model's real vocabulary and context), the tokenizer's own
encode, a second thread's clock, the server's log read back line by line.
"""
from __future__ import annotations

import json
import logging
import random
import threading
import time

import pytest
import requests

from ferroxmp.frontend.openai import schemas
from ferroxmp.frontend.auth import Keyring, cache_salt
from ferroxmp.frontend.text.prompts import PromptEncoder
from ferroxmp.frontend.text.tokenizer import TextCodec
from ferroxmp.logsafe import SafeFormatter
from serverproc import ServerProcess, serving

pytestmark = pytest.mark.timeout(180)

KEY = "validation-key"
CONTEXT = 4096  # the tiny models' whole context: long prompts are tokenized, not refused unread
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
GENERATE = {"input_ids": [5, 6], "sampling_params": {"max_tokens": 2}}


@pytest.fixture(scope="module")
def srv(tiny_models):
    with serving(tiny_models["llama"], "--page-size", "4", "--kv-pages", "2048", "--max-model-len", str(CONTEXT)) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(tiny_models):
    with serving(tiny_models["llama"], "--page-size", "4", "--kv-pages", "256", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def vocab(srv) -> int:
    return int(srv.info["worker_info"]["vocab_size"])


def assert_error(r: requests.Response, status: int, param=None, *words: str) -> dict:
    """The status, OpenAI's exact error shape, the field named, the bound spelled out."""
    assert r.status_code == status, r.text[:500]
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err)
    return err


def canary(s: ServerProcess, headers=None) -> str:
    r = requests.post(s.url + "/v1/completions", headers=headers, timeout=60, json={
        "prompt": "the canary sings", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def post(s: ServerProcess, path: str, body, headers=None) -> requests.Response:
    return requests.post(s.url + path, json=body, headers=headers, timeout=60)


# ---- every numeric parameter has both bounds, named in the 400 ---------------------------

HUGE = 10 ** 400  # Python's json writes it as 401 digits; float() of it overflows
BOUNDS = [  # (field, value, words the message must hold); "{V}" is the vocabulary size
    ("top_k", 2 ** 63, "[-1, {V}"), ("top_k", 2 ** 64, "[-1, {V}"), ("top_k", 1e308, "[-1, {V}"),
    ("top_k", -2, "[-1, {V}"), ("top_k", HUGE, "[-1, {V}"),
    ("temperature", HUGE, "[0, 100]"), ("temperature", -HUGE, "[0, 100]"), ("temperature", 101, "[0, 100]"),
    ("top_p", HUGE, "(0, 1]"), ("top_p", 0, "(0, 1]"), ("min_p", HUGE, "[0, 1]"), ("min_p", -1e308, "[0, 1]"),
    ("frequency_penalty", HUGE, "[-2, 2]"), ("presence_penalty", -HUGE, "[-2, 2]"),
    ("repetition_penalty", HUGE, "(0, 10]"), ("repetition_penalty", 0, "(0, 10]"),
    ("seed", 2 ** 63, "9223372036854775"), ("seed", -(2 ** 63) - 1, "-9223372036854775808"),
    ("max_tokens", 2 ** 64, f"{CONTEXT - 1} (the context length)"), ("n", 129, "[1, 128]"),
    ("stop_token_ids", [2 ** 63], "vocabulary [0, {V})"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("field,value,words", BOUNDS, ids=[f"{f}={str(v)[:12]}" for f, v, _ in BOUNDS])
def test_every_numeric_bound_is_checked_at_the_edge_and_named(srv, vocab, path, field, value, words):
    """Values past a bound never reach the worker: each is a 400 that names the field and
    the bound; for /generate the field is nested under sampling_params."""
    if path == "/generate" and field == "n":
        return  # /generate has no n
    if path == "/generate":
        body, param = {**GENERATE, "sampling_params": {"max_tokens": 2, field: value}}, f"sampling_params.{field}"
    else:
        body, param = {**(COMPLETION if path == "/v1/completions" else CHAT), field: value}, field
    assert_error(post(srv, path, body), 400, param, words.replace("{V}", str(vocab)))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" + b"0" * 5000])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "frequency_penalty", "top_k"])
def test_nan_infinity_and_overflowing_numbers_are_a_400(srv, literal, field):
    """Not JSON (NaN), or a number no float or int64 holds: refused while parsing."""
    raw = b'{"prompt": "hi", "max_tokens": 2, "' + field.encode() + b'": ' + literal + b"}"
    r = requests.post(srv.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert_error(r, 400)


def test_the_server_answers_the_same_after_every_bad_request(srv, vocab):
    """The canary: refused requests changed nothing (no row, page or batch was touched)."""
    before = canary(srv)
    for field, value, _ in BOUNDS:
        post(srv, "/v1/completions", {**COMPLETION, field: value})
    assert canary(srv) == before


# ---- roles, content parts, nesting, template kwargs ----------------------------------------

def test_an_unknown_chat_role_is_a_400_naming_it(srv):
    msgs = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    assert_error(post(srv, "/v1/chat/completions", {**CHAT, "messages": msgs}), 400, "messages[1].role", "wizard")


@pytest.mark.parametrize("role", ["system", "developer", "assistant", "tool"])
def test_known_roles_are_served(srv, role):
    """`tool` (with its call id) stays accepted: this template renders any role."""
    msg = {"role": role, "content": "done", **({"tool_call_id": "call_1"} if role == "tool" else {})}
    r = post(srv, "/v1/chat/completions", {**CHAT, "messages": [msg, {"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("part,param,word", [
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "messages[0].content[1].type", "image_url"),
    ({"type": "input_audio", "input_audio": {}}, "messages[0].content[1].type", "input_audio"),
    ({"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}, "messages[0].content[1].cache_control",
     "cache_control"),
    ("just a string", "messages[0].content[1]", "object"),
])
def test_an_unsupported_content_part_is_a_400_naming_it(srv, part, param, word):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look:"}, part]}]
    assert_error(post(srv, "/v1/chat/completions", {**CHAT, "messages": msgs}), 400, param, word)


def test_text_content_parts_are_joined(srv):
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    r = post(srv, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200, r.text


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("where", ["top", "prompt", "kwargs", "message"])
def test_json_nested_thousands_deep_is_a_400_not_a_recursion_error(srv, where):
    deep = _nested(5000)
    raw = {"top": deep,
           "prompt": b'{"prompt": ' + deep + b"}",
           "kwargs": b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": ' + deep + b"}}",
           "message": b'{"messages": [{"role": "user", "content": "x", "name": ' + deep + b"}]}"}[where]
    path = "/v1/completions" if where == "prompt" else "/v1/chat/completions"
    r = requests.post(srv.url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert_error(r, 400, None, "nested")
    assert "unhandled" not in srv.log()


def test_moderate_nesting_is_served(srv):
    """The depth bound (64) is far above what a real tool call's arguments hold."""
    value: object = "leaf"
    for _ in range(28):  # 56 levels, 63 with the body's own
        value = {"k": [value]}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": value}}
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "hi"}]
    r = post(srv, "/v1/chat/completions", {**CHAT, "messages": msgs})
    assert r.status_code == 200, r.text


def test_a_template_kwarg_the_template_never_reads_is_a_400(srv):
    """enable_thinking means something to Qwen3's template; this one never reads it."""
    r = post(srv, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert_error(r, 400, "chat_template_kwargs.enable_thinking", "does not use")


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tools", "self", "raise_exception"])
def test_reserved_names_in_chat_template_kwargs_are_a_400(srv, name):
    r = post(srv, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {name: []}})
    assert_error(r, 400, f"chat_template_kwargs.{name}", name)


# ---- nothing accepted and ignored ------------------------------------------------------

UNSERVED = [  # a field another change implements is skipped (see the test)
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),  # the pre-tools API
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "tail"}, "suffix"),
    ("/v1/completions", {"n": 129}, "n"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/generate", {"text": "hello"}, "text"),
    ("/generate", {"sampling_params": {"max_tokens": 2, "stop": ["x"]}}, "sampling_params.stop"),
]


@pytest.mark.parametrize("path,change,param", UNSERVED, ids=[p for _, _, p in UNSERVED])
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(srv, path, change, param):
    top = param.split(".")[0]
    if top in schemas.COMPLETION_FIELDS | schemas.CHAT_FIELDS and top not in ("n", "stream_options", "sampling_params"):
        pytest.skip(f"{top} is implemented now; its own tests cover it")
    base = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/generate": GENERATE}[path]
    assert_error(post(srv, path, {**base, **change}), 400, param, param.split(".")[-1])


def test_fields_that_ask_for_nothing_are_served(srv):
    """What SDKs send by default, or harmlessly: nulls, best_of 1, the text response format,
    tool_choice none, user, stream_options, an assistant turn copied back with its nulls."""
    echoed = {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None, "audio": None}
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}, echoed, {"role": "user", "content": "more"}],
            "response_format": {"type": "text"}, "tool_choice": "none", "tools": None, "user": "u-1",
            "logit_bias": {}, "stream_options": {"include_usage": True}, "best_of": None, "cache_salt": "s"}
    assert post(srv, "/v1/chat/completions", body).status_code == 200
    r = post(srv, "/v1/completions", {**COMPLETION, "best_of": 1, "suffix": None, "user": "u-1"})
    assert r.status_code == 200, r.text


def test_generate_checks_the_model_it_names(srv):
    """`model` on /generate is checked as on /v1, not ignored."""
    assert_error(post(srv, "/generate", {**GENERATE, "model": "gpt-9"}), 404, "model", "gpt-9")
    assert post(srv, "/generate", {**GENERATE, "model": "llama"}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("salt,ok", [("tenant-x", True), (7, False), ("s" * 257, False)])
def test_cache_salt_is_a_bounded_string(srv, path, salt, ok):
    base = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/generate": GENERATE}[path]
    r = post(srv, path, {**base, "cache_salt": salt})
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 400, "cache_salt")


# ---- size before work ----------------------------------------------------------------

def test_a_prompt_longer_than_the_context_in_bytes_is_refused_unread(srv):
    """3 MB of text cannot be under 4,096 tokens of at most 128 bytes: refused at once
    (tokenizing it takes seconds here), naming the prompt."""
    text = ("All work and no play makes Jack a dull boy. " * 70000)[:3_000_000]
    t0 = time.monotonic()
    r = post(srv, "/v1/completions", {"prompt": text, "max_tokens": 1})
    took = time.monotonic() - t0
    assert_error(r, 400, "prompt", "at least", str(CONTEXT))
    assert took < 2.0, took
    msgs = [{"role": "user", "content": text}]
    assert_error(post(srv, "/v1/chat/completions", {"messages": msgs}), 400, "messages", "at least")


def test_a_token_id_prompt_longer_than_the_context_is_refused_before_each_id_is_checked(srv):
    r = post(srv, "/generate", {"input_ids": [5] * (CONTEXT + 1)})
    assert_error(r, 400, "input_ids", str(CONTEXT))


def _longest_gap(url: str, result: dict, go: threading.Event) -> None:
    """Stream /generate and record the longest wait between two events after `go`."""
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {
        "max_tokens": 3000, "temperature": 0, "ignore_eos": True}}
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
        last, gaps = None, []
        for line in r.iter_lines():
            now = time.monotonic()
            if go.is_set() and last is not None:
                gaps.append(now - last)
            last = now
            if result.get("stop"):
                break
        result["gap"] = max(gaps) if gaps else None


def test_tokenizing_long_prompts_does_not_stall_other_streams(srv, tiny_models):
    """Three prompts just under the unread bound are tokenized (then refused: too many
    tokens) while another client streams. encode() would hold the GIL for the whole
    prompt (seconds each on this machine); the stream must not pause half that long."""
    enc = PromptEncoder.for_codec(TextCodec(tiny_models["llama"]), CONTEXT)
    size = (CONTEXT - 2) * enc.bytes_per_token  # the bound allows it: it is tokenized
    text = ("Zebras quietly jump over fox dens; 12345 " * (size // 40 + 1))[:size]
    t0 = time.monotonic()
    enc.codec.encode(text)
    alone = time.monotonic() - t0  # what one encode() would have stalled everyone for
    result: dict = {}
    go = threading.Event()
    streamer = threading.Thread(target=_longest_gap, args=(srv.url, result, go), daemon=True)
    streamer.start()
    time.sleep(1.0)
    go.set()
    threads = [threading.Thread(target=post, args=(srv, "/v1/completions", {"prompt": text, "max_tokens": 1}))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    time.sleep(0.3)
    result["stop"] = True
    streamer.join(60)
    assert result.get("gap") is not None, "the stream produced no events"
    print(f"longest stream pause {result['gap']:.3f} s; one encode() alone {alone:.3f} s")
    assert result["gap"] < max(0.5, 0.5 * alone), (result["gap"], alone)


# ---- auth --------------------------------------------------------------------------

@pytest.mark.parametrize("auth", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"BeArEr   {KEY}  "])
def test_the_bearer_scheme_is_case_insensitive(keyed, auth):
    assert requests.get(keyed.url + "/v1/models", headers={"Authorization": auth}, timeout=10).status_code == 200


@pytest.mark.parametrize("auth", [None, f"Basic {KEY}", KEY, f"Bearer {KEY}x", f"Bearer{KEY}", "Bearer "])
@pytest.mark.parametrize("path", ["/server_info", "/metrics", "/v1/models", "/stats"])
def test_server_info_and_metrics_need_the_key(keyed, auth, path):
    headers = {} if auth is None else {"Authorization": auth}
    err = assert_error(requests.get(keyed.url + path, headers=headers, timeout=10), 401)
    assert err["type"] == "authentication_error" and KEY not in json.dumps(err)
    assert requests.get(keyed.url + path, headers={"Authorization": f"bearer {KEY}"}, timeout=10).status_code == 200


def test_health_stays_open_and_metrics_public_opens_only_metrics(keyed, tiny_models):
    assert requests.get(keyed.url + "/health", timeout=10).status_code == 200
    with ServerProcess(tiny_models["llama"], "--page-size", "4", "--kv-pages", "64", "--api-key", KEY,
                       "--metrics-public") as pub:
        assert requests.get(pub.url + "/metrics", timeout=10).status_code == 200
        assert requests.get(pub.url + "/health", timeout=10).status_code == 200
        assert_error(requests.get(pub.url + "/server_info", timeout=10), 401)
        assert_error(requests.post(pub.url + "/v1/completions", json=COMPLETION, timeout=10), 401)
    assert not pub.leftovers()


def test_a_key_file_names_tenants_and_refuses_duplicates():
    ring = Keyring.parse("# ops\nacme:k-acme-1\nacme:k-acme-2\n\nbare-key\nglobex:k-globex\n")
    assert ring.check("Bearer k-acme-1") == ring.check("bearer k-acme-2") == "acme"
    assert ring.check("BEARER k-globex") == "globex"
    bare = ring.check("Bearer bare-key")
    assert bare.startswith("#") and "bare-key" not in bare and ":" not in bare
    for header in ("Bearer k-acme", "Basic k-acme-1", "", "Bearer acme:k-acme-1"):
        with pytest.raises(Exception) as e:
            ring.check(header)
        assert getattr(e.value, "status", None) == 401
    for bad in ("a:k\nb:k\n", "bad name:k\n", "", "# only a comment\n", "t:\n"):
        with pytest.raises(ValueError):
            Keyring.parse(bad)
    assert cache_salt("acme", "") == "acme" and cache_salt("acme", "x") == "acme:x" and cache_salt("", "x") == "x"


# ---- logs ------------------------------------------------------------------------------

def test_a_newline_in_a_model_name_does_not_start_a_log_line(srv):
    """The forged text must appear escaped inside the real record, never at a line start."""
    forged = "2026-01-01 00:00:00,000 INFO [frontend:1] ferroxmp.frontend: FORGED-RECORD"
    for model in ("gpt\n" + forged, "gpt\r\n" + forged, "gpt\u2028" + forged, "gpt\x1b[2K\r" + forged):
        assert_error(post(srv, "/v1/completions", {**COMPLETION, "model": model}), 404, "model")
    deadline = time.time() + 10
    while srv.log().count("FORGED-RECORD") < 4 and time.time() < deadline:
        time.sleep(0.2)
    with open(srv.log_path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    hits = [line for line in lines if "FORGED-RECORD" in line]
    assert len(hits) == 4, hits
    assert not any(line.startswith("2026-01-01") for line in lines)
    assert any("gpt\\n2026-01-01" in line for line in hits) and any("gpt\\u2028" in line for line in hits)
    assert not any("\r" in line or "\x1b" in line for line in hits)


def test_the_formatter_escapes_cuts_and_indents_tracebacks():
    fmt = SafeFormatter("%(levelname)s %(message)s")
    rec = logging.LogRecord("t", logging.INFO, __file__, 1, "model %s and %r", ("a\nb\x00c\x9b", "z" * 10000), None)
    out = fmt.format(rec)
    assert "\n" not in out and "a\\nb\\x00c\\x9b" in out and "more characters" in out and len(out) < 1000
    try:
        raise ValueError("bad\nINFO forged")
    except ValueError:
        import sys
        rec = logging.LogRecord("t", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    lines = fmt.format(rec).split("\n")
    assert lines[0] == "ERROR failed" and all(line.startswith("    ") for line in lines[1:]), lines


# ---- the prompt encoder ----------------------------------------------------------------

def test_the_byte_bound_never_exceeds_the_real_token_count(tiny_models):
    """min_tokens is a lower bound (the refusal is sound): checked against the tokenizer
    itself on random text, the worst case for it (one character a token) included."""
    codec = TextCodec(tiny_models["llama"])
    enc = PromptEncoder.for_codec(codec, 10 ** 6)
    rng = random.Random(0)
    alphabet = "ab \n\t.,;é漢字🙂\u0301\u1100\u1161\u11a8\u212a<|im_start|>"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        ids = codec.encode(text)
        assert 0 < enc.min_tokens(text) <= len(ids), text
        assert enc.encode(text, "prompt") == ids


def test_encoding_lets_other_threads_run(tiny_models):
    """The call the handlers use releases the GIL: a ticking thread keeps its pace while a
    long text is encoded (codec.encode holds it for the whole call)."""
    codec = TextCodec(tiny_models["llama"])
    enc = PromptEncoder.for_codec(codec, 10 ** 9)
    text = "Pack my box with five dozen liquor jugs. " * 30000  # ~0.6 s on a quiet 2-core box
    gaps: list = []
    stop = threading.Event()

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    t = threading.Thread(target=tick)
    t.start()
    t0 = time.perf_counter()
    enc.encode(text, "prompt")
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    assert took > 0.2, "too short a text to tell"
    assert max(gaps) < max(0.1, took / 3), (max(gaps), took)
