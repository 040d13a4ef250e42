"""`ferroxmp router`: the prefix tree, the policies, and a real router process.

Oracles: a naive list of inserted texts for the prefix tree; hand-worked loads
for the imbalance threshold; for the proxy, stub backends that record what they
received and send known bytes in awkward pieces (the client must get exactly
those bytes); and, behind the router, two real `ferroxmp serve` processes on
the tiny llama whose own answers and own counters (/metrics, usage) say where
each request went and what it hit in their prefix caches, never the router's word.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from ferroxmp.router.keys import routing_text
from ferroxmp.router.policy import CacheAware, LeastLoaded, RoundRobin
from ferroxmp.router.tree import PrefixTree, block_ids
from serverproc import ServerProcess, free_port, stream_lines

pytestmark = pytest.mark.timeout(240)

SERVER_FLAGS = ("--page-size", "4", "--kv-pages", "2048", "--max-running-requests", "16")


# ---- prefix tree --------------------------------------------------------------------

def _oracle_match(texts: list[str], query: str, block: int) -> int:
    """Whole blocks of `query` that some inserted text starts with, by plain string compare."""
    best = 0
    for t in texts:
        n = 0
        while (n + 1) * block <= min(len(t), len(query)) and t[:(n + 1) * block] == query[:(n + 1) * block]:
            n += 1
        best = max(best, n)
    return best


def test_the_tree_matches_the_longest_whole_block_prefix_of_anything_inserted():
    """Without eviction, match() must equal a string-compare oracle over every text inserted;
    a hash chain that forgot the parent would match a block seen under another prefix."""
    rng = random.Random(3)
    alphabet = "ab"  # a tiny alphabet makes shared prefixes and repeated blocks common
    tree, texts = PrefixTree(block_chars=4, max_blocks=10**6), []
    for _ in range(300):
        base = rng.choice(texts) if texts and rng.random() < 0.6 else ""
        text = base[:rng.randint(0, len(base))] + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        query = text if rng.random() < 0.5 else text[:rng.randint(0, len(text))] + rng.choice(alphabet) * 5
        assert tree.match(block_ids(query, 4)) == _oracle_match(texts, query, 4)
        tree.insert(block_ids(text, 4))
        texts.append(text)
    tree.check_integrity()


def test_a_block_seen_under_another_prefix_does_not_match():
    tree = PrefixTree(block_chars=4)
    tree.insert(block_ids("xxxxBBBB", 4))
    assert tree.match(block_ids("yyyyBBBB", 4)) == 0
    assert tree.match(block_ids("xxxxBBBBzz", 4)) == 2  # the partial block "zz" never counts


def test_the_tree_stays_bounded_evicting_least_recently_used_leaves_first():
    """Past max_blocks the oldest conversation goes, deepest blocks first; a text just inserted
    (or re-used) survives whole, and no block outlives its parent."""
    tree = PrefixTree(block_chars=2, max_blocks=12)
    old, mid, new = "aabbccddee", "ffgghhiijj", "kkllmmnnoo"  # 5 blocks each
    tree.insert(block_ids(old, 2))
    tree.insert(block_ids(mid, 2))
    tree.insert(block_ids(old, 2))  # old is used again: mid is now the least recent
    tree.insert(block_ids(new, 2))
    assert tree.size == 12
    tree.check_integrity()
    assert tree.match(block_ids(new, 2)) == 5 and tree.match(block_ids(old, 2)) == 5
    assert tree.match(block_ids(mid, 2)) == 2  # its 3 deepest blocks went, its root survived


# ---- policies -----------------------------------------------------------------------

class FakeBackend:
    def __init__(self, name: str, load: float = 0, routed: int = 0, sent: tuple = ()):
        self.name, self.load, self.routed = name, load, routed
        self.tree = PrefixTree(block_chars=4)
        for text in sent:
            self.tree.insert(block_ids(text, 4))


PROMPT = "system prompt shared by a conversation, then the turns"


@pytest.mark.parametrize("holder_load, least_load, expect", [
    (40, 5, "least"),    # 35 more (> 32) and 8x (> 1.5x): overloaded
    (40, 30, "holder"),  # only 10 more: the cache wins
    (100, 70, "holder"),  # 30 more but only 1.43x: not overloaded with abs 20
    (33, 0, "least"),    # 33 more and infinitely more
    (32, 0, "holder"),   # exactly the absolute threshold is not beyond it
])
def test_cache_aware_keeps_the_prefix_holder_until_both_imbalance_thresholds_are_crossed(
        holder_load, least_load, expect):
    abs_threshold = 20 if holder_load == 100 else 32
    policy = CacheAware(balance_abs_threshold=abs_threshold, balance_rel_threshold=1.5, cache_threshold=0.3)
    holder = FakeBackend("holder", holder_load, sent=(PROMPT,))
    least = FakeBackend("least", least_load)
    d = policy.choose([least, holder], block_ids(PROMPT + " and one more question", 4))
    assert d.backend.name == expect
    assert d.affinity == (expect == "holder")


def test_cache_aware_sends_a_weak_or_missing_match_to_the_least_loaded():
    policy = CacheAware(cache_threshold=0.5)
    holder = FakeBackend("holder", 1, sent=(PROMPT[:12],))  # 3 of the query's 13 blocks
    idle = FakeBackend("idle", 0)
    assert policy.choose([holder, idle], block_ids(PROMPT, 4)).backend.name == "idle"
    assert policy.choose([holder, idle], block_ids("nothing alike at all here", 4)).backend.name == "idle"
    assert policy.choose([holder, idle], []).backend.name == "idle"


def test_cache_aware_prefers_the_longer_match():
    policy = CacheAware(cache_threshold=0.0)
    short = FakeBackend("short", sent=(PROMPT[:20],))
    long = FakeBackend("long", 3, sent=(PROMPT,))
    assert policy.choose([short, long], block_ids(PROMPT, 4)).backend.name == "long"


def test_round_robin_alternates_and_least_loaded_breaks_ties_by_fewest_routed():
    a, b = FakeBackend("a"), FakeBackend("b")
    rr = RoundRobin()
    assert [rr.choose([a, b], []).backend.name for _ in range(4)] == ["a", "b", "a", "b"]
    a.routed, b.routed = 3, 1
    assert LeastLoaded().choose([a, b], []).backend.name == "b"
    a.load, b.load = 0, 2
    assert LeastLoaded().choose([a, b], []).backend.name == "a"


def test_the_routing_text_of_a_conversation_extends_that_of_its_earlier_turns():
    """Affinity rests on this: turn k+1's rendering starts with turn k's."""
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
             {"role": "user", "content": "more"}]
    texts = [routing_text("/v1/chat/completions", json.dumps({"messages": turns[:k]}).encode())
             for k in range(1, 5)]
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(texts, texts[1:]))
    assert "hello" in texts[2]
    assert routing_text("/v1/completions", b'{"prompt": "abc"}').endswith("abc")
    assert routing_text("/v1/completions", b'{"prompt": [[1, 2], [3]]}') == "ids:1,2"
    assert routing_text("/v1/completions", b"{not json") == ""
    # Anthropic messages and Responses input grow the same way, after their system text.
    for path, key, head in (("/v1/messages", "messages", {"system": "be brief"}),
                            ("/v1/responses", "input", {"instructions": "be brief"})):
        grown = [routing_text(path, json.dumps({**head, key: turns[1:k]}).encode()) for k in range(2, 5)]
        assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(grown, grown[1:])), path
        assert "be brief" in grown[0] and "hello" in grown[1]


# ---- a real router in front of stub backends ----------------------------------------

class Stub:
    """A backend that records requests and answers as told: `mode` "stream" sends `pieces`
    as separate HTTP chunks, "die" sends them and then drops the connection mid-chunk."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.pieces: list[bytes] = []
        self.mode = "stream"
        self.client_gone = threading.Event()
        self.health = 200
        self.running = 0
        self.delay = 0.0  # seconds before the reply's headers, as a server's first token takes
        self.metrics_key: Optional[str] = None  # /metrics answers 401 without this bearer key
        self.stored: set[str] = set()  # GET paths answered 200 {"id": ...} (a Responses store)
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    self._send(stub.health, b'{"status": "ok"}', "application/json")
                elif self.path in stub.stored:
                    self._send(200, json.dumps({"id": self.path.rsplit("/", 1)[1]}).encode(), "application/json")
                elif self.path == "/metrics" and stub.metrics_key and \
                        self.headers.get("Authorization") != f"Bearer {stub.metrics_key}":
                    self._send(401, b'{"error": {"message": "key", "type": "x", "param": null, "code": "k"}}',
                               "application/json")
                elif self.path == "/metrics":
                    text = f"ferroxmp_requests_running {stub.running}\nferroxmp_requests_waiting 0.0\n"
                    self._send(200, text.encode(), "text/plain")
                else:
                    self._send(404, b"{}", "application/json")

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                stub.received.append({"path": self.path, "body": body, "headers": dict(self.headers)})
                if stub.mode == "draining":  # what a ferroxmp server says after SIGTERM
                    self._send(503, json.dumps({"error": {"message": "draining", "type": "x", "param": None,
                                                          "code": "shutting_down"}}).encode(), "application/json")
                    return
                time.sleep(stub.delay)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("X-Request-Id", "stub-id")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if stub.mode == "endless":  # until the reader goes away
                    try:
                        for _ in range(3000):
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(stub.pieces[0]), stub.pieces[0]))
                            self.wfile.flush()
                            time.sleep(0.01)
                    except OSError:
                        stub.client_gone.set()
                    return
                for piece in stub.pieces:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
                    time.sleep(0.02)
                if stub.mode == "die":
                    self.wfile.write(b"40\r\npartial")  # a chunk that never completes
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Router:
    """`ferroxmp router` as a subprocess; stop() always ends it."""

    def __init__(self, backends: list[str], *flags: str, cwd=None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ferroxmp.cli", "router", "--port", str(self.port), *flags]
        for b in backends:
            cmd += ["--backend", b]
        self.log = tempfile.TemporaryFile()  # a file, not a pipe: nobody reads it until the end
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd)
        deadline = time.time() + 60
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if requests.get(self.url + "/health", timeout=2).status_code in (200, 503):
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline, "router never answered /health"
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def stubs():
    made: list[Stub] = []

    def make() -> Stub:
        made.append(Stub())
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def router():
    made: list[Router] = []

    def make(backends, *flags) -> Router:
        made.append(Router(backends, *flags))
        return made[-1]

    yield make
    for r in made:
        r.stop()


def _raw_post(url: str, body: dict, headers=None) -> requests.Response:
    return requests.post(url + "/v1/completions", json=body, headers=headers, stream=True, timeout=30)


def test_a_stream_reaches_the_client_byte_for_byte_with_its_headers(stubs, router):
    """Events split across chunks, a multi-byte character split in two, an SSE comment: the
    client must read exactly the backend's bytes, not a re-encoding of them."""
    stub = stubs()
    snow = "☃".encode()
    stub.pieces = [b"data: {\"a\": 1}\n", b"\ndata: {\"b\": \"" + snow[:1], snow[1:] + b"\"}\n\n",
                   b": keep-alive\r\n\r\ndata: [DO", b"NE]\n\n", b"\n\n", b"x"]
    r = router([stub.url])
    resp = _raw_post(r.url, {"prompt": "x", "stream": True})
    assert resp.status_code == 200
    assert resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers["X-Request-Id"] == "stub-id"
    assert resp.raw.read() == b"".join(stub.pieces)
    assert len(stub.received) == 1 and json.loads(stub.received[0]["body"]) == {"prompt": "x", "stream": True}


def test_a_prefix_follows_a_request_whose_reply_has_not_started_yet(stubs, router):
    """Requests sharing a long prefix that arrive while the first one is still prefilling (no
    reply headers yet) must go where it went, though that backend is now the busier one."""
    first, other = stubs(), stubs()
    for s in (first, other):
        s.pieces, s.delay = [b"data: [DONE]\n\n"], 1.5
    r = router([first.url, other.url], "--policy", "cache-aware", "--block-chars", "8")
    system = "You are a terse assistant who answers questions about rivers and bridges. " * 4
    with ThreadPoolExecutor(3) as pool:
        futures = []
        for q in ("Where?", "Why?", "How?"):
            futures.append(pool.submit(lambda p: _raw_post(r.url, {"prompt": p, "stream": True}).raw.read(),
                                       system + q))
            time.sleep(0.3)
        assert all(f.result(timeout=30) == b"data: [DONE]\n\n" for f in futures)
    assert sorted([len(first.received), len(other.received)]) == [0, 3]
    assert r.metrics()["ferroxmp_router_cache_affinity_hits_total"] == 2


def test_the_api_key_is_checked_and_the_clients_authorization_forwarded(stubs, router):
    stub = stubs()
    stub.pieces = [b"data: [DONE]\n\n"]
    r = router([stub.url], "--api-key", "sesame")
    refused = _raw_post(r.url, {"prompt": "x"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert stub.received == []  # refused at the router: the backend never saw it
    ok = _raw_post(r.url, {"prompt": "x"}, headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200 and ok.raw.read() == b"data: [DONE]\n\n"
    assert stub.received[0]["headers"]["Authorization"] == "Bearer sesame"


def test_a_backend_dying_mid_stream_ends_the_stream_with_an_error_event_and_no_retry(stubs, router):
    """Complete events arrive unchanged, the half event does not; then one error event in
    OpenAI's shape and [DONE]. The request reached the backend, so it is not sent again."""
    dying, spare = stubs(), stubs()
    dying.mode, dying.pieces = "die", [b"data: {\"n\": 1}\n\n", b"data: {\"n\": 2}\n\ndata: {\"n\"", b": 3"]
    r = router([dying.url, spare.url], "--policy", "round-robin")
    resp = _raw_post(r.url, {"prompt": "x", "stream": True})
    events = list(stream_lines(resp))
    assert events[:2] == [{"n": 1}, {"n": 2}]
    assert set(events[2]["error"]) == {"message", "type", "param", "code"} and events[3] == b"[DONE]"
    assert len(events) == 4
    assert (len(dying.received), len(spare.received)) == (1, 0)
    m = r.metrics()
    assert m["ferroxmp_router_retries_total"] == 0
    assert m[f'ferroxmp_router_upstream_errors_total{{backend="{dying.url}"}}'] == 1


def test_a_client_leaving_mid_stream_closes_the_backends_connection(stubs, router):
    """The backend must see the disconnect (that is how a ferroxmp server aborts the request),
    and the router must give back its in-flight count without calling it a backend failure."""
    stub = stubs()
    stub.mode, stub.pieces = "endless", [b"data: {\"tick\": 1}\n\n"]
    r = router([stub.url])
    resp = _raw_post(r.url, {"prompt": "x", "stream": True})
    assert resp.raw.read(len(stub.pieces[0])) == stub.pieces[0]
    resp.close()
    assert stub.client_gone.wait(20), "the backend never saw the client leave"
    _wait(lambda: r.metrics()[f'ferroxmp_router_backend_in_flight{{backend="{stub.url}"}}'] == 0, 10)
    assert r.metrics()[f'ferroxmp_router_upstream_errors_total{{backend="{stub.url}"}}'] == 0


def test_a_request_that_cannot_connect_is_retried_on_another_backend(stubs, router):
    """The first backend goes away between polls (a long --health-interval keeps the router
    from noticing): the request it was meant for is refused at connect and must be sent to
    the other one, once; the dead one is then skipped."""
    gone, alive = stubs(), stubs()
    alive.pieces = [b"data: [DONE]\n\n"]
    r = router([gone.url, alive.url], "--policy", "round-robin", "--health-interval", "3600")
    assert [b["healthy"] for b in r.health()["backends"]] == [True, True]
    gone.close()
    for _ in range(3):
        resp = _raw_post(r.url, {"prompt": "x", "stream": True})
        assert resp.status_code == 200 and resp.raw.read() == b"data: [DONE]\n\n"
    assert len(alive.received) == 3
    m = r.metrics()
    assert m["ferroxmp_router_retries_total"] == 1
    assert [b["healthy"] for b in r.health()["backends"]] == [False, True]


def test_a_draining_backends_refusal_is_retried_elsewhere(stubs, router):
    """A 503 "shutting_down" means the backend did nothing with the request: it goes to another."""
    draining, alive = stubs(), stubs()
    draining.mode, alive.pieces = "draining", [b"data: [DONE]\n\n"]
    r = router([draining.url, alive.url], "--policy", "round-robin", "--health-interval", "3600")
    resp = _raw_post(r.url, {"prompt": "x", "stream": True})
    assert resp.status_code == 200 and resp.raw.read() == b"data: [DONE]\n\n"
    assert (len(draining.received), len(alive.received)) == (1, 1)
    assert r.metrics()["ferroxmp_router_retries_total"] == 1
    assert [b["healthy"] for b in r.health()["backends"]] == [False, True]


def test_polling_drops_an_unhealthy_backend_and_brings_it_back(stubs, router):
    sick, well = stubs(), stubs()
    for s in (sick, well):
        s.pieces = [b"data: [DONE]\n\n"]
    r = router([sick.url, well.url], "--policy", "round-robin", "--health-interval", "0.2")
    sick.health = 503

    def healthy():
        return [b["healthy"] for b in r.health()["backends"]]

    _wait(lambda: healthy() == [False, True], 10)
    for _ in range(4):
        _raw_post(r.url, {"prompt": "x"}).raw.read()
    assert (len(sick.received), len(well.received)) == (0, 4)
    sick.health = 200
    _wait(lambda: healthy() == [True, True], 10)
    for _ in range(2):
        _raw_post(r.url, {"prompt": "x"}).raw.read()
    assert len(sick.received) == 1


def test_least_loaded_reads_the_backends_own_running_gauge(stubs, router):
    """The router sends nothing to a backend whose /metrics says it is busy with others' work."""
    busy, idle = stubs(), stubs()
    for s in (busy, idle):
        s.pieces = [b"data: [DONE]\n\n"]
    busy.running = 7
    r = router([busy.url, idle.url], "--policy", "least-loaded", "--health-interval", "0.2")
    _wait(lambda: r.metrics()[f'ferroxmp_router_backend_load{{backend="{busy.url}"}}'] == 7, 10)
    for _ in range(4):
        _raw_post(r.url, {"prompt": "x"}).raw.read()
    assert (len(busy.received), len(idle.received)) == (0, 4)


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "m", "max_tokens": 4, "system": "S", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/responses", {"model": "m", "input": "x", "instructions": "S"}),
    ("/v1/embeddings", {"model": "m", "input": "x"})])
def test_the_anthropic_responses_and_embeddings_routes_reach_a_backend_with_their_keys(stubs, router, path, body):
    """Clients of /v1/messages (the anthropic SDK sends x-api-key), /v1/responses and
    /v1/embeddings got a 404 from the router; now they are proxied like chat, the
    backend sees the path, body and key headers."""
    stub = stubs()
    stub.pieces = [b"data: [DONE]\n\n"]
    r = router([stub.url], "--api-key", "sesame")
    assert requests.post(r.url + path, json=body, timeout=30).status_code == 401
    got = requests.post(r.url + path, json=body, headers={"x-api-key": "sesame", "anthropic-version": "2023-06-01"},
                        timeout=30)
    assert got.status_code == 200
    seen = stub.received[-1]
    assert seen["path"] == path and seen["body"] == json.dumps(body).encode()
    assert seen["headers"]["x-api-key"] == "sesame" and seen["headers"]["anthropic-version"] == "2023-06-01"


def test_a_stored_response_is_found_on_whichever_backend_holds_it(stubs, router):
    """GET/DELETE /v1/responses/{id}: the store is per backend; the router asks each."""
    empty, holder = stubs(), stubs()
    holder.stored = {"/v1/responses/resp_1"}
    r = router([empty.url, holder.url])
    assert requests.get(r.url + "/v1/responses/resp_1", timeout=30).json() == {"id": "resp_1"}
    assert requests.get(r.url + "/v1/responses/resp_2", timeout=30).status_code == 404


def test_the_router_sends_the_backend_key_when_it_reads_a_keyed_backends_metrics(stubs, router):
    """A backend started with --api-key refuses /metrics without the key: without
    --backend-api-key the router saw load 0 on a busy backend and sent it work. The gauge
    (7) can only reach the router's backend_load through the keyed poll."""
    busy, idle = stubs(), stubs()
    for s in (busy, idle):
        s.pieces, s.metrics_key = [b"data: [DONE]\n\n"], "sesame"
    busy.running = 7
    r = router([busy.url, idle.url], "--policy", "least-loaded", "--health-interval", "0.2",
               "--backend-api-key", "sesame")
    _wait(lambda: r.metrics()[f'ferroxmp_router_backend_load{{backend="{busy.url}"}}'] == 7, 10)
    for _ in range(3):
        _raw_post(r.url, {"prompt": "x"}).raw.read()
    assert (len(busy.received), len(idle.received)) == (0, 3)
    blind = router([busy.url], "--health-interval", "0.2")  # no key: healthy, load unknown, said once
    _wait(lambda: "needs the router's --backend-api-key" in blind.output(), 10)
    assert blind.health()  # still routable
    assert _raw_post(blind.url, {"prompt": "x"}).status_code == 200


def _wait(cond, timeout: float) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not met in time"
        time.sleep(0.1)


# ---- a real router in front of real ferroxmp servers ----------------------------------

@pytest.fixture(scope="module")
def pair(tiny_models):
    """Two servers on the same tiny llama checkpoint, stopped (leaving nothing) at module end."""
    started: list[ServerProcess] = []
    try:
        for _ in range(2):
            started.append(ServerProcess(tiny_models["llama"], *SERVER_FLAGS))
        yield started
    finally:
        left = []
        for srv in started:
            srv.stop()
            left += srv.leftovers()
        assert not left, f"left behind after stop: {left}"


def _scrape(url: str) -> dict[str, float]:
    """A server's own counters: prompt, cached-prompt tokens, and requests finished (all reasons)."""
    out = {"requests": 0.0}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("ferroxmp_requests_total{"):
            out["requests"] += float(value)
        elif name in ("ferroxmp_prompt_tokens_total", "ferroxmp_cached_prompt_tokens_total"):
            out[name] = float(value)
    return out


def _settled(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Counters once two reads a scheduler heartbeat apart agree (the token counters ride on it)."""
    deadline, last = time.time() + timeout, _scrape(url)
    while time.time() < deadline:
        time.sleep(1.1)
        now = _scrape(url)
        if now == last:
            return now
        last = now
    raise TimeoutError(f"{url}/metrics did not settle: {last}")


def _grew(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _answer(url: str, path: str, body: dict) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of one greedy request, streamed or not."""
    body = {**body, "temperature": 0.0, "max_tokens": 12}
    key = "text" if path == "/v1/completions" else "message"
    if not body.get("stream"):
        r = requests.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return (choice["text"] if key == "text" else choice["message"]["content"]), choice["finish_reason"], \
            r.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    r = requests.post(url + path, json=body, stream=True, timeout=60)
    assert r.status_code == 200, r.text
    text, finish, usage = "", None, None
    for event in stream_lines(r):
        if event == b"[DONE]":
            break
        for c in event["choices"]:
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            finish = c.get("finish_reason") or finish
        usage = event.get("usage") or usage
    return text, finish, usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "The river bends past the mill and the old stone bridge"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about the old stone bridge."}]}),
])
def test_answers_through_the_router_equal_the_backends_own(pair, router, path, body, stream):
    """Round-robin sends the request once to each backend; every answer through the router must
    be the one a backend gives directly (greedy): same text, same finish, same token counts."""
    r = router([s.url for s in pair], "--policy", "round-robin")
    direct = _answer(pair[0].url, path, {**body, "stream": stream})
    assert direct[0]
    for _ in range(2):
        text, finish, usage = _answer(r.url, path, {**body, "stream": stream})
        assert (text, finish) == direct[:2]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == \
            (direct[2]["prompt_tokens"], direct[2]["completion_tokens"])


def test_round_robin_alternates_between_the_backends(pair, router):
    """Which backend served each request is read from the backends' own request counters."""
    r = router([s.url for s in pair], "--policy", "round-robin")
    served = []
    for i in range(4):
        before = [_scrape(s.url)["requests"] for s in pair]
        _answer(r.url, "/v1/completions", {"prompt": f"request number {i} about bridges"})
        after = [_scrape(s.url)["requests"] for s in pair]
        grew = [a - b for a, b in zip(after, before)]
        assert sorted(grew) == [0, 1], grew
        served.append(grew.index(1))
    assert served in ([0, 1, 0, 1], [1, 0, 1, 0])


def test_cache_aware_keeps_each_conversation_on_one_backend(pair, router):
    """Every turn of a conversation resends the ones before: under cache-aware routing all of a
    conversation's prompt tokens must land on one backend (its own counters say so) and every
    later turn must be a prefix-cache hit there (its own usage says so); a second conversation,
    arriving while the first backend is no busier, goes to the other backend."""
    r = router([s.url for s in pair], "--policy", "cache-aware")
    homes = []
    for conv in range(2):
        messages = [{"role": "system", "content": f"Conversation {conv}: you answer questions about rivers."}]
        before = [_settled(s.url) for s in pair]
        prompt_tokens, cached = 0, []
        for turn in range(4):
            messages.append({"role": "user", "content": f"Question {turn}: where does the river go after "
                                                        f"the mill, and why does it bend there?"})
            text, _, usage = _answer(r.url, "/v1/chat/completions", {"messages": messages})
            messages.append({"role": "assistant", "content": text})
            prompt_tokens += usage["prompt_tokens"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        grew = [_grew(b, _settled(s.url)) for b, s in zip(before, pair)]
        got = [g["ferroxmp_prompt_tokens_total"] for g in grew]
        assert sorted(got) == [0, prompt_tokens], got
        homes.append(got.index(prompt_tokens))
        assert all(c > 0 for c in cached[1:]), cached
        assert grew[homes[-1]]["ferroxmp_cached_prompt_tokens_total"] == sum(cached)
    assert homes[0] != homes[1]
    assert r.metrics()["ferroxmp_router_cache_affinity_hits_total"] == 6  # turns 2..4 of each


@pytest.mark.timeout(600)
def test_killing_a_backend_fails_only_its_requests_in_flight(pair, tiny_models, router):
    """Four long streams, two on each backend (round-robin; each backend's /server_info says so);
    the second backend's frontend is SIGKILLed. Its two streams must end with an error event, the
    first backend's two must finish whole; new requests all succeed on the survivor (its counters
    say so), the one meant for the dead backend after a retry (a long --health-interval keeps the
    poller out of it)."""
    survivor = pair[0]
    victim = ServerProcess(tiny_models["llama"], *SERVER_FLAGS)
    try:
        r = router([survivor.url, victim.url], "--policy", "round-robin", "--health-interval", "3600")
        body = {"prompt": "A long story about the river", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}

        def stream(_):
            """(status, SSE events or the error body): a backend that dies before its first token
            fails the request with a 502, one that dies later with an error event."""
            resp = requests.post(r.url + "/v1/completions", json=body, stream=True, timeout=120)
            return resp.status_code, list(stream_lines(resp)) if resp.status_code == 200 else resp.json()

        def in_flight(srv):
            return requests.get(srv.url + "/server_info", timeout=10).json()["in_flight"]

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, i) for i in range(4)]
            _wait(lambda: in_flight(survivor) == 2 and in_flight(victim) == 2, 60)
            os.kill(victim.pids["frontend"], signal.SIGKILL)
            results = [f.result(timeout=300) for f in futures]
        whole = [ev for status, ev in results if status == 200 and ev[-1] == b"[DONE]" and "usage" in ev[-2]]
        assert len(whole) == 2, results
        assert all(ev[-2]["usage"]["completion_tokens"] == 400 for ev in whole)
        for status, ev in results:
            if status != 200:
                assert status == 502 and ev["error"]["code"] == "backend_failed", ev
            elif ev not in whole:
                assert "error" in ev[-2] and ev[-1] == b"[DONE]", ev[-3:]
        before = _scrape(survivor.url)["requests"]
        for i in range(4):
            assert _answer(r.url, "/v1/completions", {"prompt": f"after the crash {i}"})[0]
        assert _scrape(survivor.url)["requests"] - before == 4
        assert r.metrics()["ferroxmp_router_retries_total"] == 1
        assert [b["healthy"] for b in r.health()["backends"]] == [True, False]
    finally:
        victim.stop()
    assert not victim.leftovers()


def test_bench_serving_runs_against_the_router_and_the_backends_counters_add_up(pair, router, tmp_path):
    """tools/bench_serving.py treats the router as any server; with --server-metrics-url it reads
    the backends' own counters, whose growth must equal the usage the tool summed."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "tools" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving_for_router", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses resolve annotations through it
    spec.loader.exec_module(bench)
    r = router([s.url for s in pair], "--policy", "cache-aware")
    out = tmp_path / "report.json"
    argv = ["--base-url", r.url, "--workload", "multi-turn", "--num-conversations", "3", "--num-turns", "2",
            "--input-len", "20", "--output-len", "6", "--warmup", "0", "--timeout", "60", "--out", str(out)]
    for s in pair:
        argv += ["--server-metrics-url", s.url]
    assert bench.main(argv) == 0
    summary = json.loads(out.read_text())["summaries"]["A"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["server"]["ferroxmp_prompt_tokens_total"] == summary["prompt_tokens"]
    assert summary["server"]["ferroxmp_cached_prompt_tokens_total"] == summary["cached_tokens"]
    assert summary["server_cache_hit_rate"] == summary["cached_tokens"] / summary["prompt_tokens"]
