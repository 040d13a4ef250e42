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
import zmq

from ferroxmp.gpu_worker.faults import Faults
from ferroxmp.protocol import (BatchResult, GenerateReq, Ready, RowStep, SamplingParams, TokenOut, encode, pack_ids,
                               unpack_ids)
from serverproc import pages_leaked, serving, stream_generate

FLAGS = ("--page-size", "4", "--kv-pages", "1024", "--max-running-requests", "16")
POISON_TOKEN = 99  # a forward holding it raises
POISON_SEED = 4242  # a row with this seed cannot be sampled
HEALTHY = [[5 + i, 17, 33 + i, 2, 71] for i in range(4)]
N_TOKENS = 120


# ---- in process: the runner alone, driven as the scheduler would under overlap ------------

RUNNER_PROMPTS = {0: [5, 17, 33, 2, 71], 1: [8, 9, 10, 11, 12, 13], 2: [40, 41, 3]}


def sampled(res) -> dict:
    return dict(zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist()))


def prefill_steps(rows):
    return [RowStep(r, 0, len(RUNNER_PROMPTS[r]), True) for r in rows]


def decode_steps(rows, n_before: int):
    """Steps planned as if every row had sampled n_before tokens (what overlap assumes)."""
    return [RowStep(r, len(RUNNER_PROMPTS[r]) + n_before - 1, 1, True) for r in rows]


@pytest.fixture
def solo(tiny_models, make_harness) -> dict:
    h = make_harness(tiny_models["llama"])
    out, _ = h.generate(RUNNER_PROMPTS, 2)
    return out


def test_the_runner_fails_an_unsampleable_row_alone_and_skips_it_in_batches_planned_behind(
        tiny_models, make_harness, solo):
    """Row 1 cannot be sampled. Its batch must still sample rows 0 and 2 (their solo
    tokens) and report row 1 in row_errors; the next batch, planned as if row 1 had a
    token (its step starts past its known tokens), must not be refused whole."""
    h = make_harness(tiny_models["llama"])
    h.runner.faults = Faults(sample_raise_seed=7)
    news = [h.new_row(r, p, seed=7 if r == 1 else 0) for r, p in RUNNER_PROMPTS.items()]
    first = h.run(news, prefill_steps([0, 1, 2]))
    assert first.error is None and set(first.row_errors) == {1}
    assert sampled(first) == {0: solo[0][0], 2: solo[2][0]}
    second = h.run([], decode_steps([0, 1, 2], 1))
    assert second.error is None, second.error
    assert set(second.row_errors) == {1} and "earlier batch" in second.row_errors[1]
    assert sampled(second) == {0: solo[0][1], 2: solo[2][1]}


def test_a_forward_that_raises_registers_its_rows_and_the_next_batch_runs(tiny_models, make_harness, solo):
    """The forward holding row 1's prompt raises: rows 0 and 1 fail (row_errors, no
    batch error), yet their NewRows are registered, so the batch planned behind it —
    their decode steps plus a new row 2 — is not refused: row 2 gets its solo token;
    and a NewRow restarting slot 0 clears the failure."""
    poison = next(t for t in RUNNER_PROMPTS[1] if all(t not in RUNNER_PROMPTS[r] + solo[r] for r in (0, 2)))
    h = make_harness(tiny_models["llama"])
    h.runner.faults = Faults(forward_raise_token=poison)
    first = h.run([h.new_row(r, RUNNER_PROMPTS[r]) for r in (0, 1)], prefill_steps([0, 1]))
    assert first.error is None and set(first.row_errors) == {0, 1} and sampled(first) == {}
    second = h.run([h.new_row(2, RUNNER_PROMPTS[2])], decode_steps([0, 1], 1) + prefill_steps([2]))
    assert second.error is None, second.error
    assert set(second.row_errors) == {0, 1} and sampled(second) == {2: solo[2][0]}
    third = h.run([h.new_row(0, RUNNER_PROMPTS[0])], prefill_steps([0]))
    assert third.error is None and third.row_errors == {} and sampled(third) == {0: solo[0][0]}


# ---- end to end -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_models):
    env = {"FERROXMP_FAULT_INJECT": f"forward_raise_token={POISON_TOKEN};sample_raise_seed={POISON_SEED}"}
    with serving(tiny_models["llama"], *FLAGS, env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(server) -> list[list[int]]:
    """Each healthy prompt's greedy answer, alone, before any fault."""
    out = []
    for ids in HEALTHY:
        r = stream_generate(server.url, ids, N_TOKENS, timeout=60)
        assert r.error is None and len(r.tokens) == N_TOKENS, r
        out.append(r.tokens)
    return out


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
