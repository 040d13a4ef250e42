"""The whole server (`ferroxmp serve`) through the official `openai` client.

Oracles: `transformers` on the same float32 checkpoint (its chat template, greedy
`generate`, and the log-softmax of its logits), the tokenizer's own token
counts and decodes, and the radix contract (the page-aligned shared prefix is
exactly what a second request adopts). One server per model shape is started
lazily for the whole module and always stopped, leaving nothing behind.
"""
from __future__ import annotations

import functools
import http.client
import json
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch

from serverproc import ServerProcess

pytestmark = pytest.mark.timeout(180)

FLAGS = ("--page-size", "4", "--kv-pages", "1024", "--max-running-requests", "32")
PAGE = 4
EOS = (2, 0)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MULTIBYTE = "héllo wörld — 你好 🙂"
# Long enough that a Mistral prompt outruns its 64-token sliding window.
FILLER = " ".join(f"Paragraph {i} tells how the river bends past the mill and the old stone bridge."
                  for i in range(8))
METRIC_NAMES = (
    "ferroxmp_kv_pages_total", "ferroxmp_kv_pages_free", "ferroxmp_kv_pages_cached",
    "ferroxmp_kv_pages_in_use", "ferroxmp_requests_running", "ferroxmp_requests_waiting",
    "ferroxmp_prompt_tokens_total", "ferroxmp_generation_tokens_total",
    "ferroxmp_cached_prompt_tokens_total", "ferroxmp_requests_total",
    "ferroxmp_time_to_first_token_seconds", "ferroxmp_inter_token_latency_seconds",
    "ferroxmp_e2e_request_latency_seconds", "ferroxmp_queue_time_seconds",
    "ferroxmp_worker_busy_seconds_total")


# ---- fixtures and helpers ----------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tiny_models):
    """shape -> a running server, started on first use, all stopped at module end."""
    started: dict[str, ServerProcess] = {}

    def get(shape: str) -> ServerProcess:
        if shape not in started:
            started[shape] = ServerProcess(tiny_models[shape], *FLAGS)
        return started[shape]

    yield get
    left = []
    for srv in started.values():
        srv.stop()
        left += srv.leftovers()
    assert not left, f"left behind after stop: {left}"


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers("llama")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf_llama(tiny_models):
    return hf(tiny_models["llama"])


@functools.lru_cache(maxsize=None)
def hf(path: str):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, model


def chat_ids(tok, messages: list[dict]) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    out = out["input_ids"] if hasattr(out, "keys") else out
    return list(out)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, stopping on EOS (as ours does) or at n tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_logprobs(model, ids: list[int], new: list[int]) -> torch.Tensor:
    """log_softmax rows that predicted each of `new` after `ids`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + new])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(ids) - 1: len(ids) - 1 + len(new)]


def generate(server: ServerProcess, ids: list[int], **sampling) -> dict:
    r = requests.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": sampling}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def metrics(server: ServerProcess) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value}."""
    r = requests.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_metrics(server: ServerProcess, cond, timeout: float = 8.0) -> dict[str, float]:
    deadline = time.time() + timeout
    m = metrics(server)
    while not cond(m):
        assert time.time() < deadline, f"metrics never satisfied the condition: {m}"
        time.sleep(0.2)
        m = metrics(server)
    return m


def settled_metrics(server: ServerProcess) -> dict[str, float]:
    """A snapshot taken when the server is idle and two heartbeats agree, so no count
    from an earlier request is still on its way."""
    keys = ("ferroxmp_prompt_tokens_total", "ferroxmp_generation_tokens_total",
            "ferroxmp_cached_prompt_tokens_total")
    idle = lambda m: m["ferroxmp_requests_running"] == 0 and m["ferroxmp_kv_pages_in_use"] == 0  # noqa: E731
    prev = wait_metrics(server, idle)
    deadline = time.time() + 10
    while True:
        time.sleep(0.6)  # longer than the scheduler's heartbeat period
        m = wait_metrics(server, idle)
        if all(m[k] == prev[k] for k in keys):
            return m
        assert time.time() < deadline, "token counters never settled on an idle server"
        prev = m


def greedy_chat(client, messages, max_tokens: int = 16, **kw):
    return client.chat.completions.create(model="llama", messages=messages, max_tokens=max_tokens,
                                          temperature=0, **kw)


# ---- the oracle: transformers on the same checkpoint -----------------------------

def test_models_lists_the_served_model_by_the_name_requests_use(client, server):
    """Clients discover the name to send from /v1/models; it must be one the server
    then accepts."""
    models = client.models.list().data
    assert [m.id for m in models] == ["llama"]
    r = client.completions.create(model=models[0].id, prompt="hi", max_tokens=2)
    assert r.model == "llama" and r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("shape", ["llama", "qwen3", "mistral"])
def test_greedy_chat_equals_transformers_generate_with_the_same_template(servers, tiny_models, shape):
    """A wrong chat template, RoPE offset, KV page mapping or sliding window changes
    the greedy tokens within a few steps; the prompt is longer than Mistral's window
    of 64 and carries multi-byte text, so the window and UTF-8 handling are exercised.
    Both sides stop on EOS or at N tokens, so equal ids mean equal stopping too. A
    repeat of the prompt, served from the prefix cache, must give the same ids."""
    srv = servers(shape)
    tok, model = hf(tiny_models[shape])
    messages = [{"role": "system", "content": "You answer in one line."},
                {"role": "user", "content": f"{MULTIBYTE} {FILLER}"}]
    prompt = chat_ids(tok, messages)
    assert len(prompt) > 64 + 20, "the prompt must outrun the sliding window"
    n = 24
    ref = hf_greedy(model, prompt, n)

    native = generate(srv, prompt, max_tokens=n, temperature=0)
    assert native["output_ids"] == ref

    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        r = c.chat.completions.create(model=shape, messages=messages, max_tokens=n, temperature=0)
    finally:
        c.close()
    ch = r.choices[0]
    assert ch.message.content == tok.decode(ref, skip_special_tokens=True)
    assert ch.finish_reason == ("stop" if ref[-1] in EOS else "length")
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(ref)

    warm = generate(srv, prompt, max_tokens=n, temperature=0)  # contract 4: a cache hit, same answer
    assert warm["output_ids"] == ref
    if shape != "mistral":  # a sliding-window row drops its early pages, so it publishes none
        assert warm["cached_tokens"] >= len(prompt) - PAGE


def test_chat_logprobs_are_transformers_log_softmax_and_the_chosen_is_the_top(client, server, hf_llama):
    """Logprobs must come from the raw logits of the step that chose the token: the
    chosen one's value is the largest of top_logprobs under greedy, every value is a
    log-probability (<= 0), and each matches transformers' log_softmax to 1e-4."""
    tok, model = hf_llama
    messages = [{"role": "user", "content": "Name three rivers."}]
    r = greedy_chat(client, messages, 12, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content
    ids = generate(server, chat_ids(tok, messages), max_tokens=12, temperature=0)["output_ids"]
    assert r.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    ref = hf_logprobs(model, chat_ids(tok, messages), ids)
    for j, e in enumerate(content):
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and all(v <= 0 for v in tops) and e.logprob <= 0
        assert tops == sorted(tops, reverse=True)
        assert e.logprob == pytest.approx(max(tops), abs=1e-6)
        assert bytes(e.top_logprobs[0].bytes) == bytes(e.bytes)
        assert e.logprob == pytest.approx(ref[j, ids[j]].item(), abs=1e-4)
        assert tops == pytest.approx(ref[j].topk(5).values.tolist(), abs=1e-4)


def test_completion_logprobs_are_transformers_log_softmax(client, server, hf_llama):
    """Completions report an int number of alternatives per position; the chosen
    token's logprob is the top one under greedy and equals transformers' value."""
    tok, model = hf_llama
    prompt = "The mill by the river"
    r = client.completions.create(model="llama", prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    ids = tok(prompt).input_ids
    out = generate(server, ids, max_tokens=10, temperature=0)["output_ids"]
    ref = hf_logprobs(model, ids, out)
    for j, (chosen, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        assert chosen <= 0 and all(v <= 0 for v in top.values())
        # Distinct tokens may share a display string (a lone byte shows as U+FFFD), so
        # the dict can hold fewer than 3 entries and a later one may overwrite a key.
        assert 1 <= len(top) <= 3 and lp.tokens[j] in top
        assert max(top.values()) <= chosen + 1e-6
        assert chosen == pytest.approx(ref[j, out[j]].item(), abs=1e-4)
        assert chosen == pytest.approx(ref[j].max().item(), abs=1e-4)


# ---- streaming, n, seeds, stop strings, echo ------------------------------------

def test_a_streamed_chat_adds_up_to_the_non_streamed_answer(client):
    """Streaming must not lose, duplicate or reorder text: the deltas joined equal the
    non-streamed greedy content, the first delta names the assistant role, the last
    carries the finish reason, and the usage chunk counts what the non-streamed one did."""
    messages = [{"role": "user", "content": f"Say something about {MULTIBYTE}."}]
    whole = greedy_chat(client, messages, 20)
    stream = greedy_chat(client, messages, 20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c for c in chunks if c.choices]
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and not chunks[-1].choices
    u, w = chunks[-1].usage, whole.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (w.prompt_tokens, w.completion_tokens,
                                                                       w.total_tokens)
    # The streamed request came second, so its prompt was (page-aligned) cached.
    assert u.prompt_tokens_details.cached_tokens == (u.prompt_tokens - 1) // PAGE * PAGE


def test_a_streamed_completion_adds_up_to_the_non_streamed_text(client, server, hf_llama):
    """Same as for chat, and the text is the tokenizer's decode of the greedy ids."""
    tok, _ = hf_llama
    prompt = f"Once upon a time {MULTIBYTE}"
    whole = client.completions.create(model="llama", prompt=prompt, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="llama", prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    ids = generate(server, tok(prompt).input_ids, max_tokens=20, temperature=0)["output_ids"]
    assert whole.choices[0].text == tok.decode(ids, skip_special_tokens=True)
    assert whole.usage.prompt_tokens == len(tok(prompt).input_ids)
    assert whole.usage.completion_tokens == len(ids) == 20


def test_n_2_gives_two_choices_each_equal_to_a_single_run(client):
    """Under greedy both choices must be the n=1 answer (they are separate rows that
    may share the prompt's pages); usage counts the prompt once and both outputs."""
    messages = [{"role": "user", "content": "Two of the same, please."}]
    solo = greedy_chat(client, messages, 10)
    r = greedy_chat(client, messages, 10, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.message.content for c in r.choices] == [solo.choices[0].message.content] * 2
    assert r.usage.prompt_tokens == solo.usage.prompt_tokens
    assert r.usage.completion_tokens == 2 * solo.usage.completion_tokens


def test_a_seed_reproduces_a_sampled_answer_and_another_seed_changes_it(client):
    """temperature 0.8: the same seed must give the same text (also across n=2, where
    the choices take seed and seed+1, so they differ from each other); a different
    seed gives different text (with 24 tokens over a 1000-token vocabulary a chance
    collision is negligible)."""
    kw = dict(model="llama", prompt="Sample me", max_tokens=24, temperature=0.8)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=4321, **kw).choices[0].text
    assert a == b
    assert a != c
    pair = client.completions.create(seed=1234, n=2, **kw)
    again = client.completions.create(seed=1234, n=2, **kw)
    texts = [ch.text for ch in sorted(pair.choices, key=lambda ch: ch.index)]
    assert texts == [ch.text for ch in sorted(again.choices, key=lambda ch: ch.index)]
    assert texts[0] == a and texts[1] != a


def _split_stop(tok, ids: list[int]) -> tuple[str, int]:
    """A 4-character stop string whose first occurrence in decode(ids) straddles a
    token boundary (2 characters each side), and its offset."""
    text = tok.decode(ids)
    for i in range(len(ids) // 2, len(ids) - 1):
        b = len(tok.decode(ids[:i]))
        s = text[b - 2:b + 2]
        if (b >= 2 and len(s) == 4 and "\ufffd" not in s and s.strip() == s and text.find(s) == b - 2
                and not tok.decode(ids[:i]).endswith("\ufffd")):
            return s, b - 2
    pytest.fail(f"no stop string straddling a token boundary in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_spanning_two_tokens_trims_the_text_right_before_it(client, server, hf_llama, stream):
    """The stop string is half in one token and half in the next: matching per token
    would miss it. The answer must end exactly before it, with finish_reason stop."""
    tok, _ = hf_llama
    prompt = "The story of the mill"
    ids = generate(server, tok(prompt).input_ids, max_tokens=40, temperature=0,
                   ignore_eos=True)["output_ids"]
    full = tok.decode(ids)
    stop, at = _split_stop(tok, ids)
    r = client.completions.create(model="llama", prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                  stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert text == full[:at]
    assert reason == "stop"


def test_echo_returns_the_multibyte_prompt_unchanged_before_the_completion(client):
    """Echo must prepend the prompt text byte for byte (no re-encoding damage to
    multi-byte characters) and leave the completion itself unchanged."""
    prompt = f"Start: {MULTIBYTE}"
    plain = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0)
    echoed = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text


@pytest.mark.parametrize("echo,stream", [(False, False), (True, False), (False, True), (True, True)])
def test_completion_text_offsets_index_the_returned_text(client, hf_llama, echo, stream):
    """text_offset[k] must be where token k's text starts in the returned text (the
    echoed prompt included, and counted across streamed chunks): a client cuts the
    text by these offsets. Offsets counted in token pieces instead of characters
    drift past every multi-byte character."""
    tok, _ = hf_llama
    prompt = f"Start: {MULTIBYTE} and then"
    r = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                                  echo=echo, stream=stream)
    chunks = list(r) if stream else [r]
    text = "".join(c.choices[0].text for c in chunks)
    lp = chunks[0].choices[0].logprobs
    for c in chunks[1:]:
        if c.choices[0].logprobs is not None:
            lp.tokens += c.choices[0].logprobs.tokens
            lp.text_offset += c.choices[0].logprobs.text_offset
    n_prompt = len(tok(prompt).input_ids) if echo else 0
    assert len(lp.tokens) == len(lp.text_offset) == n_prompt + 8
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(0 <= o <= len(text) for o in lp.text_offset)
    if echo:
        assert lp.text_offset[n_prompt] == len(prompt)
    for piece, at in zip(lp.tokens, lp.text_offset):
        if "\ufffd" not in piece and piece not in SPECIALS:  # pieces with no text of their own
            assert text[at:at + len(piece)] == piece, (piece, at, text)


def test_multibyte_chat_content_round_trips_through_the_template(client, server, hf_llama):
    """The server's own rendering and tokenization of multi-byte messages (an
    assistant turn included) must be transformers': the same count, and the same
    greedy answer as /generate on transformers' ids. The answer must reach the client
    whole: its UTF-8 bytes are the concatenation of the token bytes."""
    tok, _ = hf_llama
    messages = [{"role": "user", "content": MULTIBYTE}, {"role": "assistant", "content": "你好 🙂"},
                {"role": "user", "content": "wörld?"}]
    r = greedy_chat(client, messages, 16, logprobs=True, extra_body={"ignore_eos": True})
    ids = chat_ids(tok, messages)
    assert r.usage.prompt_tokens == len(ids)
    out = generate(server, ids, max_tokens=16, temperature=0, ignore_eos=True)["output_ids"]
    assert r.choices[0].message.content == tok.decode(out, skip_special_tokens=True)
    joined = b"".join(bytes(e.bytes) for e in r.choices[0].logprobs.content)
    assert joined.decode("utf-8", "replace") == r.choices[0].message.content


# ---- usage and the prefix cache -------------------------------------------------

def test_a_shared_system_prompt_is_reported_as_cached_on_the_second_request(client, server, hf_llama):
    """The first request over a fresh 500-token system prompt adopts next to nothing;
    the second adopts exactly the page-aligned common prefix (contract 2), and reports
    it in usage.prompt_tokens_details.cached_tokens. prompt_tokens are the template's
    token count and completion_tokens what /generate produces for the same prompt."""
    tok, _ = hf_llama
    system = f"Session {uuid.uuid4().hex}. " + " ".join(f"rule {i}: be kind to rivers." for i in range(30))
    conv = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in ("What is a mill?", "Why do rivers bend?")]
    ids = [chat_ids(tok, m) for m in conv]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert common >= 200, "the shared prefix must be long"
    first = greedy_chat(client, conv[0], 8)
    second = greedy_chat(client, conv[1], 8)
    # Only the template's header and "Session " (plus a chance match of a hex digit or
    # two) can be in the tree already: far below the 500 shared tokens.
    assert first.usage.prompt_tokens_details.cached_tokens <= 16
    assert second.usage.prompt_tokens_details.cached_tokens == (common // PAGE) * PAGE
    for r, p in zip((first, second), ids):
        assert r.usage.prompt_tokens == len(p)
        out = generate(server, p, max_tokens=8, temperature=0)["output_ids"]
        assert r.usage.completion_tokens == len(out)
        assert r.usage.total_tokens == len(p) + len(out)


# ---- metrics and disconnects ---------------------------------------------------

def test_metrics_list_every_name_and_token_counters_move_by_the_usage_totals(client, server):
    """The counters mirror the scheduler's totals: after these requests, the prompt,
    generation and cached-prompt counters moved by exactly the usage sums, and the
    finish-reason counter by the number of choices."""
    before = settled_metrics(server)
    for name in METRIC_NAMES:
        assert any(k == name or k.startswith(name + "{") or k.startswith(name + "_") for k in before), name
    assert before["ferroxmp_kv_pages_total"] == 1024
    usages = []
    for i in range(4):
        r = client.completions.create(model="llama", prompt=f"Count me {i} " * (i + 1), max_tokens=5 + i,
                                      temperature=0, extra_body={"ignore_eos": True})
        usages.append(r.usage)
    want = {"ferroxmp_prompt_tokens_total": sum(u.prompt_tokens for u in usages),
            "ferroxmp_generation_tokens_total": sum(u.completion_tokens for u in usages),
            "ferroxmp_cached_prompt_tokens_total": sum(u.prompt_tokens_details.cached_tokens for u in usages)}
    after = wait_metrics(server, lambda m: m["ferroxmp_generation_tokens_total"]
                         >= before["ferroxmp_generation_tokens_total"] + want["ferroxmp_generation_tokens_total"])
    time.sleep(0.6)
    after = metrics(server)
    for k, v in want.items():
        assert after[k] - before[k] == v, k
    key = 'ferroxmp_requests_total{finish_reason="length"}'
    assert after[key] - before.get(key, 0) == 4
    assert after["ferroxmp_worker_busy_seconds_total"] > before["ferroxmp_worker_busy_seconds_total"]
    assert after["ferroxmp_kv_pages_free"] + after["ferroxmp_kv_pages_cached"] == 1024


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_row_and_pages(client, server, stream):
    """Closing the stream (or giving up on a non-streamed answer) must abort the
    request: within a few seconds nothing runs, no page is held by a row, the abort
    is counted, fewer than max_tokens were generated and no more are afterwards. A leak
    here would slowly starve the pool. (The tiny model decodes ~2,000+ tokens a second
    with --decode-steps: what it generated before the abort landed is no measure.)"""
    before = settled_metrics(server)
    abort_key = 'ferroxmp_requests_total{finish_reason="abort"}'
    kw = dict(model="llama", messages=[{"role": "user", "content": "Go on forever."}], max_tokens=4000,
              temperature=0, extra_body={"ignore_eos": True})
    if stream:
        with client.chat.completions.create(stream=True, **kw) as events:
            it = iter(events)
            for _ in range(3):
                next(it)
            wait_metrics(server, lambda m: m["ferroxmp_requests_running"] == 1, timeout=3)
    else:  # sent, and the connection closed once it runs, its answer never read
        url = urllib.parse.urlsplit(server.url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        body = {k: v for k, v in kw.items() if k != "extra_body"} | kw["extra_body"]
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json", **(server.headers or {})})
        wait_metrics(server, lambda m: m["ferroxmp_requests_running"] == 1, timeout=3)
        conn.close()
    m = wait_metrics(server, lambda m: m["ferroxmp_requests_running"] == 0
                     and m["ferroxmp_kv_pages_in_use"] == 0, timeout=5)
    assert m.get(abort_key, 0) - before.get(abort_key, 0) == 1
    generated = settled_metrics(server)["ferroxmp_generation_tokens_total"]
    assert generated - before["ferroxmp_generation_tokens_total"] < kw["max_tokens"]
    time.sleep(1.5)
    assert settled_metrics(server)["ferroxmp_generation_tokens_total"] == generated
    assert m["ferroxmp_kv_pages_free"] + m["ferroxmp_kv_pages_cached"] == 1024
    assert greedy_chat(client, [{"role": "user", "content": "still there?"}], 4).choices[0].finish_reason


# ---- concurrency ---------------------------------------------------------------

def test_64_concurrent_streamed_chats_all_complete_and_each_matches_its_solo_run(client):
    """More streams than rows (32): half must queue, all must finish, and batching
    must not change an answer: each greedy one, and each seeded sampled one (its
    noise is a function of seed and position only), equals the same request run
    alone."""
    def request(i: int) -> dict:
        sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.9, seed=i)
        return dict(model="llama", messages=[{"role": "user", "content": f"Question {i}: what does river "
                                              f"{i * 7} carry?"}], max_tokens=12,
                    extra_body={"ignore_eos": True}, **sampling)

    solo = {i: client.chat.completions.create(**request(i)).choices[0].message.content for i in range(64)}

    def run(i: int) -> tuple[int, str, str]:
        text, reason = [], None
        for chunk in client.chat.completions.create(stream=True, **request(i)):
            for ch in chunk.choices:
                text.append(ch.delta.content or "")
                reason = ch.finish_reason or reason
        return i, "".join(text), reason

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, range(64)))
    assert all(reason == "length" for _, _, reason in results), results
    mismatched = [i for i, text, _ in results if text != solo[i]]
    assert not mismatched, f"answers changed by batching: {mismatched}"
