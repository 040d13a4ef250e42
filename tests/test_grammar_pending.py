"""A grammar that is slow to compile holds up only its own request.

Measured before this: a response_format schema of a few thousand optional properties
was compiled inside the worker's batch loop (minutes with xgrammar); no row stepped,
liveness declared the worker dead and every client got 503. Here the compile is made
slow on purpose (FERROXMP_FAULT_INJECT grammar_compile_sleep: a schema whose
description holds FERROXMP_SLOW_COMPILE sleeps 3 s on its compile thread), past
--max-grammar-compile-seconds 2. Oracles: a plain streamed request sent while the
compile is pending gets all its tokens and finishes before the slow request is
answered; the slow request is a 400 naming the bound; the server then serves a
constrained request (validated by jsonschema) and its /metrics count the compiles.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from serverproc import metric, serving, stream_generate

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(240)

SLEEP_S, BOUND_S = 3.0, 2.0
FLAGS = ("--page-size", "4", "--kv-pages", "2048", "--max-running-requests", "8",
         "--max-grammar-compile-seconds", str(BOUND_S))
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok"],
          "properties": {"ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 5}}}
SLOW = {**SCHEMA, "description": "FERROXMP_SLOW_COMPILE"}


def chat(srv, schema, **extra):
    body = {"model": "llama", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 200,
            "temperature": 1.0, "seed": 3, "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": schema}}, **extra}
    return requests.post(srv.url + "/v1/chat/completions", json=body, headers=srv.headers, timeout=60)


@pytest.fixture(scope="module")
def srv(tiny_models):
    env = {"FERROXMP_FAULT_INJECT": f"grammar_compile_sleep={SLEEP_S}"}
    with serving(tiny_models["llama"], *FLAGS, env=env) as s:
        yield s


def test_a_plain_stream_flows_while_a_grammar_compiles_and_the_overdue_grammar_is_a_400(srv):
    """If the compile ran in the batch loop, the plain stream would wait the whole 3 s
    sleep (and finish after the slow request's answer)."""
    stream_generate(srv.url, [5, 6, 7, 8], 24, timeout=30)  # warm
    t_idle, idle_first = time.monotonic(), {}
    idle = stream_generate(srv.url, [9, 10, 11, 13], 24, timeout=30,
                           on_first=lambda: idle_first.setdefault("t", time.monotonic()))
    assert idle.error is None and len(idle.tokens) == 24
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        slow = pool.submit(lambda: (chat(srv, SLOW), time.monotonic()))
        time.sleep(0.5)  # the slow request is pending by now
        t_plain = time.monotonic()
        first = {}
        plain = stream_generate(srv.url, [9, 10, 11, 12], 24, timeout=30,
                                on_first=lambda: first.setdefault("t", time.monotonic()))
        plain_done = time.monotonic()
        resp, slow_done = slow.result()
    assert plain.error is None and plain.done and len(plain.tokens) == 24, plain
    assert plain_done < slow_done and plain_done - t0 < SLEEP_S, (plain_done - t0, slow_done - t0)
    # docs/BENCHMARKS.md section 15 quotes these; no assertion (contended CPU)
    print(f"TTFT idle {idle_first['t'] - t_idle:.3f} s, while a compile is pending {first['t'] - t_plain:.3f} s")
    assert resp.status_code == 400, resp.text
    assert "--max-grammar-compile-seconds" in resp.json()["error"]["message"], resp.text
    assert slow_done - t0 >= BOUND_S


def test_the_server_serves_on_and_counts_compiles_after_an_overdue_grammar(srv):
    """A compile that outlived its bound must leave no pending request or broken state:
    a constrained request afterwards validates, the same schema again is a cache hit."""
    time.sleep(SLEEP_S)  # the overdue compile (if any is still running) has ended
    for _ in range(2):
        r = chat(srv, SCHEMA)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "stop"
        jsonschema.validate(json.loads(ch["message"]["content"]), SCHEMA)
    time.sleep(1.2)  # a fresh Stats heartbeat
    assert metric(srv.url, "ferroxmp_grammar_pending", srv.headers) == 0
    assert metric(srv.url, "ferroxmp_grammar_cache_hits_total", srv.headers) >= 1
    assert metric(srv.url, "ferroxmp_grammar_cache_misses_total", srv.headers) >= 1
    assert metric(srv.url, "ferroxmp_grammar_compile_seconds_count", srv.headers) >= 1


@pytest.mark.parametrize("schema,needle", [
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1001)}}, "1000 properties"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
])
def test_a_schema_over_the_bounds_or_unenforceable_is_a_400_naming_why(srv, schema, needle):
    """Such a schema must never reach the worker: it is refused at the edge, by field."""
    r = chat(srv, schema)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == "response_format.json_schema.schema", err
