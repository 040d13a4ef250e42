"""Worker faults fail only what they touch, and never hang the server.

A `top_k` of 2^63 once made the worker fail a whole batch: every request sharing
it ended with an error, and the batches planned behind it under overlap were
refused too ("step names row 6, which no NewRow started") — the scheduler and
the worker out of step. Faults are injected here through the test-only
FERROXMP_FAULT_INJECT (ferroxmp/gpu_worker/faults.py), with overlap on:

- a row that cannot be sampled, among healthy rows: only its request fails;
- a forward that raises: the requests in it end with an error, the server keeps
  serving with the same answers, and no page leaks;
- malformed frames straight into the scheduler's and the worker's sockets are
  logged and dropped, and the server keeps answering.

Figures are printed with `-s` for docs/RELIABILITY.md.
"""
from __future__ import annotations

import glob
import os
import threading
import time

import pytest
import requests
import zmq

from ferroxmp.protocol import BatchResult, GenerateReq, Ready, SamplingParams, TokenOut, encode, pack_ids
from serverproc import ServerProcess, stream_generate

FLAGS = ("--page-size", "4", "--kv-pages", "1024", "--max-running-requests", "16")
POISON_TOKEN = 99  # a forward holding it raises
POISON_SEED = 4242  # a row with this seed cannot be sampled
HEALTHY = [[5 + i, 17, 33 + i, 2, 71] for i in range(4)]
N_TOKENS = 120


@pytest.fixture(scope="module")
def server(tiny_models):
    env = {"FERROXMP_FAULT_INJECT": f"forward_raise_token={POISON_TOKEN};sample_raise_seed={POISON_SEED}"}
    srv = ServerProcess(tiny_models["llama"], *FLAGS, env=env)
    try:
        yield srv
    finally:
        srv.stop()
    assert srv.leftovers() == [], srv.log()


@pytest.fixture(scope="module")
def reference(server) -> list[list[int]]:
    """Each healthy prompt's greedy answer, alone, before any fault."""
    out = []
    for ids in HEALTHY:
        r = stream_generate(server.url, ids, N_TOKENS, timeout=60)
        assert r.error is None and len(r.tokens) == N_TOKENS, r
        out.append(r.tokens)
    return out


def metric(url: str, name: str) -> float:
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def pages_leaked(url: str, timeout: float = 30.0) -> int:
    """Once idle: pages held by no row and no tree entry are free; any other is a leak."""
    deadline = time.time() + timeout
    while metric(url, "ferroxmp_requests_running") or metric(url, "ferroxmp_requests_waiting"):
        assert time.time() < deadline, "the server never went idle"
        time.sleep(0.3)
    time.sleep(1.2)  # a fresh Stats heartbeat
    total, free = metric(url, "ferroxmp_kv_pages_total"), metric(url, "ferroxmp_kv_pages_free")
    return int(total - free - metric(url, "ferroxmp_kv_pages_cached"))


def run_healthy_with(url: str, poison) -> tuple[list, object]:
    """Stream every healthy prompt; once all are decoding, send `poison()` among them."""
    results: list = [None] * len(HEALTHY)
    barrier = threading.Barrier(len(HEALTHY) + 1)

    def one(i: int) -> None:
        results[i] = stream_generate(url, HEALTHY[i], N_TOKENS, timeout=60, on_first=lambda: barrier.wait(60))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(HEALTHY))]
    for t in threads:
        t.start()
    barrier.wait(120)
    bad = poison()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a healthy stream hung"
    return results, bad


def test_a_row_that_cannot_be_sampled_fails_alone_and_its_batch_completes(server, reference):
    """The poisoned row shares its batch with four decoding rows (it is sent once they
    all stream). It must end with an error (not hang, not succeed); each healthy
    stream must finish with exactly its solo answer; nothing leaks."""
    results, bad = run_healthy_with(server.url, lambda: stream_generate(
        server.url, [8, 9, 10, 11], N_TOKENS, timeout=60, seed=POISON_SEED))
    print(f"\nSAMPLE FAULT: {len(HEALTHY) + 1} sent, {sum(r.finish == 'length' for r in results)} completed, "
          f"1 poisoned -> {'error' if bad.error else bad.finish}")
    assert bad.error is not None and bad.finish != "length", bad
    assert [r.error for r in results] == [None] * len(HEALTHY), server.log()
    assert [r.tokens for r in results] == reference
    assert pages_leaked(server.url) == 0


def test_a_forward_that_raises_fails_its_requests_and_the_server_keeps_serving(server, reference):
    """The failing forward holds the poison prompt's chunk and whatever decoded with
    it: those end with an error, others may complete, none may hang or return wrong
    tokens; afterwards every healthy prompt gets its reference answer and no page
    leaked."""
    results, bad = run_healthy_with(server.url, lambda: stream_generate(
        server.url, [8, POISON_TOKEN, 10], N_TOKENS, timeout=60))
    errors = [r for r in results if r.error is not None]
    print(f"\nFORWARD FAULT: {len(HEALTHY) + 1} sent, {len(HEALTHY) - len(errors)} completed, "
          f"{len(errors) + 1} errors (the poisoned one and its batch)")
    assert bad.error is not None and bad.finish != "length", bad
    for r, want in zip(results, reference):
        assert r.error is not None or r.tokens == want, "a request that completed has a wrong answer"
        assert r.error is None or r.finish != "length"
    assert server.proc.poll() is None
    after = [stream_generate(server.url, ids, N_TOKENS, timeout=60) for ids in HEALTHY]
    assert [r.tokens for r in after] == reference, server.log()
    assert pages_leaked(server.url) == 0


def garbage_frames() -> list[bytes]:
    real = encode(GenerateReq("x", pack_ids([1, 2, 3]), SamplingParams()))
    return [b"", b"\x00", os.urandom(64), b"\xc1" * 9, b"\x81\xa3foo\xa3bar", real[: len(real) // 2],
            encode(Ready("impostor", 1)), encode(TokenOut([])),
            encode(BatchResult(batch_id=10**9)), b"\xde\xad\xbe\xef" * 1000]


def test_malformed_frames_on_the_scheduler_and_worker_sockets_are_dropped(server, reference):
    """Truncated, foreign and wrong-typed frames (and a result for a batch that does not
    exist) go straight into the scheduler's two sockets and the worker's; each process
    must log and drop them, and the server must answer with the reference tokens."""
    run_dir = glob.glob(os.path.join(server.tmp, "ferroxmp-*"))[0]
    ctx = zmq.Context()
    try:
        for name in ("scheduler", "worker_results", "worker"):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect("ipc://" + os.path.join(run_dir, name + ".sock"))
            for frame in garbage_frames():
                sock.send(frame)
            sock.close()
    finally:
        ctx.term()
    time.sleep(1.0)
    after = [stream_generate(server.url, ids, N_TOKENS, timeout=60) for ids in HEALTHY]
    assert [r.tokens for r in after] == reference, server.log()
    with open(server.log_path) as f:
        log = f.read()
    assert log.count("dropped") >= 3 * len(garbage_frames()), server.log()
    assert server.proc.poll() is None
    assert pages_leaked(server.url) == 0
