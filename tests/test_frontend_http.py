"""The real frontend process over HTTP, with this test playing the scheduler over ZMQ.

`FakeScheduler` binds the scheduler's and the supervisor's PULL sockets and pushes
TokenOuts to the frontend: each GenerateReq is answered by a `Plan` (scripted
tokens, a refusal, or tokens then silence) plus heartbeats. Oracles: the text is
`tokenizers`' decode of the scripted ids, usage counts come from the script, and
the messages the frontend sent (GenerateReq / AbortReq) are checked as received.
Every fixture kills its frontend process and removes its run directory.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import requests
import zmq
from tokenizers import Tokenizer

from ferroxmp import protocol
from ferroxmp.config import ServerArgs
from ferroxmp.protocol import AbortReq, GenerateReq, Logprobs, RowOut, Shutdown, Stats, TokenOut, pack_ids

pytestmark = pytest.mark.timeout(120)

KEY = "sekret"
MAX_MODEL_LEN = 256
ORACLE_TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé → 漢字 🙂 and more words here. " * 4


@dataclass
class Plan:
    tokens: list[int] = field(default_factory=list)
    finish: Optional[str] = "length"  # None: after the tokens, stay silent until aborted
    delay: float = 0.0  # seconds between tokens
    refuse: Optional[tuple[int, str]] = None
    cached: int = 3


@dataclass
class _Row:
    req: GenerateReq
    plan: Plan
    k: int = 0
    due: float = 0.0


class FakeScheduler:
    def __init__(self, run_dir: str, default_plan: Callable[[GenerateReq], Plan]):
        ep = protocol.endpoints(run_dir)
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(ep["scheduler"])
        self.sup = self.ctx.socket(zmq.PULL)
        self.sup.bind(ep["supervisor"])
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(ep["frontend"])
        self.default_plan = self.plan = default_plan
        self.received: list = []
        self.readies: list = []
        self.frozen = False  # a hung scheduler: receives, sends nothing at all
        self.stats = Stats(pages_total=64, pages_free=64)
        self.rows: dict[str, _Row] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        if not self.frozen:
            self.push.send(protocol.encode(msg))

    def wait_for(self, cond: Callable[[], object], timeout: float = 10.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            time.sleep(0.02)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def reqs(self) -> list[GenerateReq]:
        return [m for m in list(self.received) if isinstance(m, GenerateReq)]

    def aborts(self) -> list[AbortReq]:
        return [m for m in list(self.received) if isinstance(m, AbortReq)]

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        poller.register(self.sup, zmq.POLLIN)
        last_beat = 0.0
        while not self._stop.is_set():
            for sock, _ in poller.poll(5):
                msg = protocol.decode(sock.recv())
                if sock is self.sup:
                    self.readies.append(msg)
                else:
                    self._on_message(msg)
            now = time.monotonic()
            outs = self._step(now)
            if outs or now - last_beat > 0.25:
                self.send(TokenOut(outs=outs, stats=self.stats))
                last_beat = now

    def _on_message(self, msg) -> None:
        self.received.append(msg)
        if isinstance(msg, GenerateReq):
            plan = self.plan(msg)
            if plan.refuse:
                self.send(TokenOut(outs=[RowOut(rid=msg.rid, finish_reason="error", status=plan.refuse[0],
                                                error=plan.refuse[1])]))
            else:
                self.rows[msg.rid] = _Row(msg, plan, due=time.monotonic())
        elif isinstance(msg, AbortReq) and msg.rid in self.rows:
            del self.rows[msg.rid]
            self.send(TokenOut(outs=[RowOut(rid=msg.rid, finish_reason=msg.finish_reason)]))

    def _step(self, now: float) -> list[RowOut]:
        outs = []
        for rid, row in list(self.rows.items()):
            p = row.plan
            if now < row.due or (row.k >= len(p.tokens) and p.finish is None):
                continue
            last = row.k + 1 >= len(p.tokens)
            out = RowOut(rid=rid, finish_reason=p.finish if last else None,
                         prompt_tokens=len(protocol.unpack_ids(row.req.input_ids)) if row.k == 0 else 0,
                         cached_tokens=p.cached if row.k == 0 else 0, queue_time=0.01)
            if row.k < len(p.tokens):
                t = p.tokens[row.k]
                out.token_ids = pack_ids([t])
                if row.req.params.logprobs is not None:
                    n, lp = row.req.params.logprobs, -0.25 * (row.k + 1)
                    out.logprobs = [Logprobs(lp, [(t + j) % 997 for j in range(n)], [lp - j for j in range(n)])]
            outs.append(out)
            row.k += 1
            row.due = now + p.delay
            if last and p.finish is not None:
                del self.rows[rid]
        return outs

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in (self.pull, self.sup, self.push):
            s.close(linger=0)
        self.ctx.term()


@dataclass
class Frontend:
    proc: subprocess.Popen
    fake: FakeScheduler
    run_dir: str
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@pytest.fixture(scope="module")
def tok(tiny_models) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(tiny_models["llama"], "tokenizer.json"))


@pytest.fixture(scope="module")
def oracle_ids(tok) -> list[int]:
    return tok.encode(ORACLE_TEXT, add_special_tokens=False).ids


def _default_plan(oracle_ids):
    def plan(req: GenerateReq) -> Plan:
        return Plan(tokens=oracle_ids[: req.params.max_tokens])
    return plan


def launch(model: str, oracle_ids: list[int], parent_cmd: Optional[list[str]] = None, **overrides) -> Frontend:
    run_dir = tempfile.mkdtemp(prefix="fxfe-")
    fake = FakeScheduler(run_dir, _default_plan(oracle_ids))
    args = ServerArgs(model=model, port=0, http_threads=48, api_key=KEY, max_body_bytes=4096,
                      shutdown_grace=10.0).to_dict()
    args.update(overrides)
    info = {"num_pages": 64, "page_size": 16, "max_model_len": MAX_MODEL_LEN, "max_rows": 8, "vocab_size": 1000,
            "eos_token_ids": [2, 0], "sliding_window": None, "model_type": "llama", "dtype": "float32",
            "device": "cpu"}
    with open(os.path.join(run_dir, "launch.json"), "w") as f:
        json.dump({"args": args, "worker_info": info,
                   "pids": {"scheduler": 11, "workers": [12], "supervisor": os.getpid()}}, f)
    log_path = os.path.join(run_dir, "frontend.log")
    cmd = [sys.executable, "-m", "ferroxmp.frontend.server", "--run-dir", run_dir]
    with open(log_path, "w") as logf:
        proc = subprocess.Popen((parent_cmd or []) + cmd, stdout=logf, stderr=subprocess.STDOUT,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fe = Frontend(proc, fake, run_dir, 0, log_path)
    try:
        ready = fake.wait_for(lambda: fake.readies or proc.poll() is not None, 30, "Ready from the frontend")
        assert fake.readies, f"frontend exited with {proc.returncode}:\n{fe.log()}"
        msg = fake.readies[0]
        assert isinstance(msg, protocol.Ready) and msg.name == "frontend", ready
        fe.port = msg.info["port"]
        fake.wait_for(lambda: requests.get(fe.url + "/health", timeout=5).status_code == 200, 10, "/health 200")
    except BaseException:
        stop(fe)
        raise
    return fe


def stop(fe: Frontend) -> None:
    if fe.proc.poll() is None:
        fe.proc.kill()
    try:
        fe.proc.wait(timeout=10)
    finally:
        fe.fake.close()
        shutil.rmtree(fe.run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def fe(tiny_models, oracle_ids):
    f = launch(tiny_models["llama"], oracle_ids)
    yield f
    stop(f)


@pytest.fixture
def own_fe(tiny_models, oracle_ids):
    """A frontend of its own, for tests that end the process."""
    made: list[Frontend] = []

    def make(**kw) -> Frontend:
        made.append(launch(tiny_models["llama"], oracle_ids, **kw))
        return made[-1]
    yield make
    for f in made:
        stop(f)


@pytest.fixture
def api(fe):
    fe.fake.plan = fe.fake.default_plan
    fe.fake.frozen = False
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {KEY}"
    yield s
    s.close()
    fe.fake.plan = fe.fake.default_plan


def sse_events(resp: requests.Response) -> list:
    """Parse an SSE body strictly: every event is one `data: ...` line then a blank line."""
    raw = resp.content
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data: ") and b"\n" not in block, block
        payload = block[len(b"data: "):]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def assert_error(resp: requests.Response, status: int, param: Optional[str] = None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"].startswith("application/json"), resp.headers
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# ---- completions, chat, generate ------------------------------------------------------

def test_a_completion_is_the_decode_of_the_scheduler_tokens(fe, api, tok, oracle_ids):
    """Text, usage and the GenerateReq itself: prompt ids are the tokenizer's, the
    answer is tokenizers' decode of exactly the ids the scheduler produced."""
    r = api.post(fe.url + "/v1/completions", json={"model": "llama", "prompt": "Hello there", "max_tokens": 12,
                                                    "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "llama"
    (choice,) = body["choices"]
    assert choice["text"] == tok.decode(oracle_ids[:12]) and choice["finish_reason"] == "length"
    prompt = tok.encode("Hello there").ids
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12, "total_tokens": len(prompt) + 12,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    req = fe.fake.reqs()[-1]
    assert protocol.unpack_ids(req.input_ids).tolist() == prompt
    assert req.params.max_tokens == 12 and req.params.temperature == 0.0 and req.arrival > 0


def test_a_streamed_completion_is_framed_as_sse_and_adds_up_to_the_text(fe, api, tok, oracle_ids):
    """Strict SSE framing, usage only in its own final chunk (null before, as OpenAI),
    and the chunks concatenate to the oracle decode."""
    r = api.post(fe.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20
    chunks = events[:-2]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(oracle_ids[:20])
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_sse_events_are_flushed_one_by_one(fe, api, oracle_ids):
    """Waitress must not buffer the stream: the first event reaches the client while the
    scheduler is still producing the later tokens."""
    fe.fake.plan = lambda req: Plan(tokens=oracle_ids[:4], delay=0.3)
    arrivals = []
    with api.post(fe.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "stream": True},
                  stream=True, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 5 and arrivals[-1] - arrivals[0] > 0.6


def test_a_streamed_chat_opens_with_the_role_and_adds_up_to_the_text(fe, api, tok, oracle_ids, tiny_models):
    """The role comes once, first; content adds up to the decode (multi-byte characters
    split over tokens included); the prompt sent is the chat template's ids."""
    from ferroxmp.frontend.text.tokenizer import TextCodec
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}]
    r = api.post(fe.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 60, "stream": True})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == tok.decode(oracle_ids[:60])
    assert "漢字" in tok.decode(oracle_ids[:60]) and all(d["content"] for d in deltas[:-1])
    assert len(deltas) < 60  # tokens holding half a character were not sent as empty chunks
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    sent = protocol.unpack_ids(fe.fake.reqs()[-1].input_ids).tolist()
    assert sent == TextCodec(tiny_models["llama"]).encode_chat(msgs)


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(fe, api):
    """Chat's default max_tokens is what the context leaves, not 16."""
    r = api.post(fe.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    req = fe.fake.reqs()[-1]
    assert req.params.max_tokens == MAX_MODEL_LEN - len(protocol.unpack_ids(req.input_ids))


def test_n_choices_per_prompt_get_their_own_rows_and_seeds(fe, api, tok, oracle_ids):
    """prompts x n rows with distinct rids and seeds s, s+1 (identical seeds would give
    identical choices); prompt tokens are counted once per prompt, not per choice."""
    before = len(fe.fake.reqs())
    r = api.post(fe.url + "/v1/completions", json={"prompt": ["one", "two words"], "n": 2, "seed": 7,
                                                    "max_tokens": 5})
    body = r.json()
    reqs = fe.fake.reqs()[before:]
    assert len(reqs) == 4 and len({q.rid for q in reqs}) == 4
    assert sorted(q.params.seed for q in reqs) == [7, 7, 8, 8]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == tok.decode(oracle_ids[:5]) for c in body["choices"])
    prompt_len = len(tok.encode("one").ids) + len(tok.encode("two words").ids)
    assert body["usage"]["prompt_tokens"] == prompt_len and body["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_across_tokens_trims_the_text_and_stops_the_row(fe, api, tok, oracle_ids, stream):
    """The stop string straddles a token boundary; the client gets the text before it,
    finish_reason 'stop', and the scheduler gets AbortReq(rid, 'stop')."""
    pieces = [tok.decode([t]) for t in oracle_ids[:12]]
    stop = pieces[4][-2:] + pieces[5][:2]
    full = tok.decode(oracle_ids[:30])
    expected = full[:full.find(stop)]
    before = len(fe.fake.reqs())
    r = api.post(fe.url + "/v1/completions", json={"prompt": "x", "max_tokens": 30, "stop": [stop, "zzz"],
                                                    "stream": stream})
    if stream:
        events = sse_events(r)
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        finish = events[-2]["choices"][0]["finish_reason"]
    else:
        text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert (text, finish) == (expected, "stop")
    rid = fe.fake.reqs()[before].rid
    fe.fake.wait_for(lambda: any(a.rid == rid and a.finish_reason == "stop" for a in fe.fake.aborts()),
                     5, "AbortReq(stop)")


def test_echo_prepends_the_prompt(fe, api, tok, oracle_ids):
    """echo returns the prompt text itself in front of the completion."""
    r = api.post(fe.url + "/v1/completions", json={"prompt": "Echo me:", "echo": True, "max_tokens": 3})
    assert r.json()["choices"][0]["text"] == "Echo me:" + tok.decode(oracle_ids[:3])


def test_completion_logprobs_name_tokens_offsets_and_values(fe, api, tok):
    """Token strings, the scheduler's values, top-n sizes, and offsets that point at each
    token inside the returned text."""
    ids = tok.encode("plain ascii words for logprobs").ids
    fe.fake.plan = lambda req: Plan(tokens=ids)
    r = api.post(fe.url + "/v1/completions", json={"prompt": "x", "max_tokens": len(ids), "logprobs": 2})
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"] == [-0.25 * (k + 1) for k in range(len(ids))]
    assert all(len(top) == 2 for top in lp["top_logprobs"])
    assert all(c["text"][o:o + len(t)] == t for o, t in zip(lp["text_offset"], lp["tokens"]))


def test_chat_logprobs_bytes_add_up_to_the_content(fe, api, oracle_ids):
    """Multi-byte text: each entry's bytes are the token's real bytes, so their
    concatenation is the UTF-8 of the message even where tokens split characters."""
    r = api.post(fe.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 60, "logprobs": True, "top_logprobs": 3})
    c = r.json()["choices"][0]
    content = c["logprobs"]["content"]
    assert len(content) == 60 and all(len(e["top_logprobs"]) == 3 for e in content)
    assert bytes(b for e in content for b in e["bytes"]) == c["message"]["content"].encode("utf-8")
    assert any(0x80 <= e["bytes"][0] for e in content if e["bytes"])


@pytest.mark.parametrize("stream", [False, True])
def test_generate_returns_the_token_ids(fe, api, oracle_ids, stream):
    """The native endpoint returns exactly the scheduler's ids, streamed or not."""
    r = api.post(fe.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 6},
                                             "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        ids = [t for e in events[:-1] for t in e["output_ids"]]
        assert ids == oracle_ids[:6] and events[-2]["finish_reason"] == "length"
    else:
        assert r.json() == {"output_ids": oracle_ids[:6], "finish_reason": "length", "prompt_tokens": 3,
                            "cached_tokens": 3}


def test_many_concurrent_streams_each_get_their_own_text(fe, api, tok, oracle_ids):
    """Routing by rid under concurrency: a mixed-up queue shows up as a wrong length."""
    def one(i: int) -> str:
        r = requests.post(fe.url + "/v1/completions", headers=api.headers, timeout=60,
                          json={"prompt": f"p{i}", "max_tokens": 1 + i % 17, "stream": True})
        return "".join(e["choices"][0]["text"] for e in sse_events(r)[:-1])

    with ThreadPoolExecutor(40) as pool:
        texts = list(pool.map(one, range(80)))
    assert texts == [tok.decode(oracle_ids[:1 + i % 17]) for i in range(80)]


# ---- errors ------------------------------------------------------------------------------

ERROR_CASES = [  # (id, method, path, kwargs, status, param)
    ("bad-type", "post", "/v1/completions", {"json": {"prompt": "x", "temperature": "hot"}}, 400, "temperature"),
    ("bad-range", "post", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}}, 400, "top_logprobs"),
    ("bad-json", "post", "/v1/completions", {"data": b"{not json", "headers": {"Content-Type": "application/json"}},
     400, None),
    ("too-long", "post", "/v1/completions", {"json": {"prompt": list(range(3, MAX_MODEL_LEN + 3))}}, 400, "prompt"),
    ("over-context", "post", "/v1/completions", {"json": {"prompt": "x", "max_tokens": MAX_MODEL_LEN}}, 400,
     "max_tokens"),
    ("no-key", "post", "/v1/completions", {"json": {"prompt": "x"}, "headers": {"Authorization": ""}}, 401, None),
    ("wrong-key", "get", "/v1/models", {"headers": {"Authorization": "Bearer nope"}}, 401, None),
    ("generate-no-key", "post", "/generate", {"json": {"input_ids": [1]}, "headers": {"Authorization": ""}}, 401,
     None),
    ("unknown-model", "post", "/v1/completions", {"json": {"prompt": "x", "model": "gpt-9"}}, 404, "model"),
    ("unknown-path", "get", "/v1/nothing", {}, 404, None),
    ("wrong-method", "get", "/v1/completions", {}, 405, None),
    ("too-big", "post", "/v1/completions", {"json": {"prompt": "x" * 5000}}, 413, None),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_an_error_has_openai_shape_and_the_next_request_still_succeeds(fe, api, case):
    """Each bad request gets its status with a JSON error naming the field; the server
    is unharmed, so a good request right after it succeeds."""
    _, method, path, kwargs, status, param = case
    r = getattr(api, method)(fe.url + path, timeout=30, **kwargs)
    assert_error(r, status, param)
    assert "Traceback" not in r.text and "<html" not in r.text.lower()
    rid = r.headers["X-Request-Id"]
    fe.fake.wait_for(lambda: rid in fe.log(), 5, "the error logged with its request id")
    ok = api.post(fe.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("status", [400, 503])
@pytest.mark.parametrize("stream", [False, True])
def test_a_scheduler_refusal_becomes_its_http_status(fe, api, status, stream):
    """A 'can never fit' refusal is a 400 and a queue timeout a 503, also for streams
    (headers wait for the first token) and for n > 1."""
    fe.fake.plan = lambda req: Plan(refuse=(status, f"refused with {status} for the test"))
    r = api.post(fe.url + "/v1/completions", json={"prompt": "x", "stream": stream, "n": 2})
    err = assert_error(r, status)
    assert err["message"] == f"refused with {status} for the test"
    assert err["type"] == ("invalid_request_error" if status == 400 else "service_unavailable_error")
    fe.fake.plan = fe.fake.default_plan
    assert api.post(fe.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def _raw_post(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(data)).encode()
              + b"\r\n\r\n" + data)
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request(fe, api, oracle_ids, stream):
    """Streaming: closed after the first event; non-streamed: closed while waiting. Either
    way the scheduler must hear AbortReq(rid, 'abort') instead of computing for nobody."""
    fe.fake.plan = lambda req: Plan(tokens=oracle_ids[:100], delay=0.05)
    before = len(fe.fake.reqs())
    s = _raw_post(fe.port, {"prompt": "x", "max_tokens": 100, "stream": stream})
    try:
        rid = fe.fake.wait_for(lambda: len(fe.fake.reqs()) > before and fe.fake.reqs()[before].rid, 10, "request")
        if stream:
            got = b""
            while b"data: " not in got:
                got += s.recv(4096)
    finally:
        s.close()
    fe.fake.wait_for(lambda: any(a.rid == rid and a.finish_reason == "abort" for a in fe.fake.aborts()),
                     10, "AbortReq(abort)")
    assert fe.fake.rows.get(rid) is None


# ---- health, info, metrics ---------------------------------------------------------------

def test_server_info_models_and_health(fe, api):
    """Operators find the process ids and pool size here, with the key (process ids and
    arguments are not for anonymous callers); the key is never echoed."""
    assert requests.get(fe.url + "/health", timeout=5).json() == {"status": "ok"}
    assert requests.get(fe.url + "/server_info", timeout=5).status_code == 401
    info = api.get(fe.url + "/server_info", timeout=5).json()
    assert info["processes"] == {"supervisor": os.getpid(), "frontend": fe.proc.pid, "scheduler": 11, "workers": [12]}
    assert info["worker_info"]["num_pages"] == 64 and info["args"]["api_key"] == "***"
    models = api.get(fe.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["llama"]


def _metrics(fe) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(fe.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_mirror_the_scheduler_stats_and_count_requests(fe, api):
    """Gauges and counters equal the last Stats exactly (a collector, not re-added deltas),
    and one finished request moves its counter and each histogram by one."""
    fe.fake.stats = Stats(running=2, waiting=3, pages_total=64, pages_free=40, pages_cached=10, pages_in_use=14,
                          prompt_tokens=1234, generation_tokens=567, cached_prompt_tokens=89, worker_busy_seconds=1.5)
    time.sleep(0.6)
    before = _metrics(fe)
    api.post(fe.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    after = _metrics(fe)
    want = {"ferroxmp_kv_pages_total": 64, "ferroxmp_kv_pages_free": 40, "ferroxmp_kv_pages_cached": 10,
            "ferroxmp_kv_pages_in_use": 14, "ferroxmp_requests_running": 2, "ferroxmp_requests_waiting": 3,
            "ferroxmp_prompt_tokens_total": 1234, "ferroxmp_generation_tokens_total": 567,
            "ferroxmp_cached_prompt_tokens_total": 89, "ferroxmp_worker_busy_seconds_total": 1.5}
    assert {k: after[(k, ())] for k in want} == want
    key = ("ferroxmp_requests_total", (("finish_reason", "length"),))
    assert after[key] == before.get(key, 0) + 1
    for h in ("time_to_first_token", "e2e_request_latency", "queue_time", "inter_token_latency"):
        name = f"ferroxmp_{h}_seconds_count"
        assert after[(name, ())] == before[(name, ())] + 1


# ---- lifecycle ---------------------------------------------------------------------------

def _in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # surfaced by the test's assertions
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _post(fe: Frontend, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(fe.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30, **kw)


def test_shutdown_fails_in_flight_requests_and_exits_nonzero(own_fe, oracle_ids):
    """A Shutdown (another process died) must end every waiting client with an error,
    never a hang: SSE gets an error event and [DONE], a plain request a 503."""
    fe = own_fe()
    fe.fake.plan = lambda req: Plan(tokens=oracle_ids[:2], finish=None)
    ts, streamed = _in_thread(lambda: _post(fe, "/v1/completions", {"prompt": "a", "stream": True}))
    tp, plain = _in_thread(lambda: _post(fe, "/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}]}))
    fe.fake.wait_for(lambda: len(fe.fake.reqs()) == 2 and not any(r.k < 2 for r in fe.fake.rows.values()), 10,
                     "both requests running")
    time.sleep(0.3)
    fe.fake.send(Shutdown(reason="worker 0 died"))
    ts.join(15)
    tp.join(15)
    events = sse_events(streamed["value"])
    assert events[-1] == "[DONE]" and "worker 0 died" in events[-2]["error"]["message"]
    assert events[0]["choices"][0]["text"]  # the tokens before the failure were delivered
    assert_error(plain["value"], 503)
    assert fe.proc.wait(timeout=15) != 0


def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_zero(own_fe, tok, oracle_ids):
    """A rolling restart must not cut running answers: the running request completes
    whole, a new one gets 503, and the process exits 0."""
    fe = own_fe()
    fe.fake.plan = lambda req: Plan(tokens=oracle_ids[:10], delay=0.15)
    t, box = _in_thread(lambda: _post(fe, "/v1/completions", {"prompt": "a", "max_tokens": 10}))
    fe.fake.wait_for(lambda: fe.fake.reqs(), 10, "the request")
    fe.proc.send_signal(signal.SIGTERM)
    fe.fake.wait_for(lambda: requests.get(fe.url + "/health", timeout=5).status_code == 503, 5, "/health 503")
    err = assert_error(_post(fe, "/v1/completions", {"prompt": "late"}), 503)
    assert "shutting down" in err["message"]
    t.join(15)
    assert box["value"].status_code == 200
    assert box["value"].json()["choices"][0]["text"] == tok.decode(oracle_ids[:10])
    assert fe.proc.wait(timeout=15) == 0
    assert len(fe.fake.reqs()) == 1


def test_a_silent_scheduler_turns_health_503_but_fails_no_waiting_request(own_fe, oracle_ids):
    """A scheduler silent for ~6.5 s (paused, not dead) used to fail every waiting client
    with 503 after 5 s (issue 12). Death is reported by the supervisor (a Shutdown);
    silence only turns /health 503. The waiting request must complete with every token
    once the scheduler speaks again, and /health recover."""
    fe = own_fe()
    fe.fake.plan = lambda req: Plan(tokens=oracle_ids[:2], delay=9.0)
    box: list = []
    t = threading.Thread(target=lambda: box.append(_post(fe, "/v1/completions", {"prompt": "a"})))
    t.start()
    fe.fake.wait_for(lambda: any(r.k >= 1 for r in list(fe.fake.rows.values())), 10, "the first token")
    fe.fake.frozen = True
    time.sleep(5.5)
    assert_error(requests.get(fe.url + "/health", timeout=5), 503)
    time.sleep(1.0)
    assert t.is_alive() and not box, f"a silent scheduler failed a waiting request: {box and box[0].text}"
    fe.fake.frozen = False
    t.join(25)
    assert box and box[0].status_code == 200, box and box[0].text
    assert box[0].json()["usage"]["completion_tokens"] == 2
    fe.fake.wait_for(lambda: requests.get(fe.url + "/health", timeout=5).status_code == 200, 5, "recovery")


def test_the_frontend_exits_when_its_parent_dies(own_fe):
    """Started by an intermediate parent that is then SIGKILLed (no chance to clean up):
    the frontend must notice and exit on its own within seconds."""
    parent = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(120)"]
    fe = own_fe(parent_cmd=parent)
    pid = fe.fake.readies[0].pid
    assert pid != fe.proc.pid
    fe.proc.kill()
    fe.proc.wait(5)

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                return "State:\tZ" in f.read()
        except FileNotFoundError:
            return True
    try:
        fe.fake.wait_for(gone, 8, "the orphaned frontend to exit")
    finally:
        if not gone():  # never leave an orphan behind, even when the test fails
            os.kill(pid, signal.SIGKILL)
