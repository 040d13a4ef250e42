"""A stalled process is not a dead one.

A 5 s SIGSTOP/SIGCONT of the scheduler, the worker or the frontend while greedy
requests stream (what a long GC pause, swapping or a debugger looks like) must
cost latency only: every request completes with the tokens the same requests
get unpaused. The frontend used to fail every in-flight request with 503 "the
scheduler stopped responding" when a heartbeat was 5 s late. A process silent
past --stall-timeout, on the other hand, is stuck: the supervisor logs the
approach, dumps its Python stacks and stops the server as for a death.

Figures (requests, completions, errors, the longest pause a stream saw) are
printed with `-s` for docs/RELIABILITY.md.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from serverproc import ServerProcess, StreamResult, pages_leaked, stream_generate, serving

FLAGS = ("--page-size", "4", "--kv-pages", "2048", "--max-running-requests", "16", "--max-model-len", "4096")
N_REQUESTS = int(os.environ.get("FERROXMP_STALL_REQUESTS", "4"))
# Long enough that every stream is still generating when the pause hits: a stream waits at
# the barrier on its first token while the server goes on, and the tiny model streams
# hundreds of tokens a second (300 were sometimes all generated before the pause).
MAX_TOKENS = int(os.environ.get("FERROXMP_STALL_TOKENS", "2000"))
PAUSE_S = 5.0
PROMPTS = [[11 + i, 40 + 3 * i, 7, 90 + i, 5 * i + 2] for i in range(N_REQUESTS)]


def stream_all(url: str, started: threading.Event | None = None) -> list[StreamResult]:
    """Stream every prompt at once; `started` is set when each has its first tokens."""
    results: list = [None] * len(PROMPTS)
    first = threading.Barrier(len(PROMPTS) + 1) if started else None

    def one(i: int) -> None:
        results[i] = stream_generate(url, PROMPTS[i], MAX_TOKENS, timeout=60,
                                     on_first=(lambda: first.wait(30)) if first else None)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    if first is not None:
        first.wait(60)
        started.set()
    for t in threads:
        t.join(MAX_TOKENS / 10 + 120)
    assert not any(t.is_alive() for t in threads), "a stream never ended"
    return results


@pytest.fixture(scope="module")
def server(tiny_models):
    with serving(tiny_models["llama"], *FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def unpaused(server) -> list[list[int]]:
    results = stream_all(server.url)
    assert all(r.error is None and r.finish == "length" for r in results), results
    return [r.tokens for r in results]


@pytest.mark.parametrize("victim", ["scheduler", "worker", "frontend"])
def test_a_five_second_pause_of_any_process_costs_latency_but_no_request_or_token(server, unpaused, victim):
    """Each stream must see the pause (a gap of at least 4 s, so the pause really hit
    it mid-flight) and still end with finish_reason "length", no error event, and
    exactly the unpaused tokens; the server keeps running."""
    started = threading.Event()
    box: list = []
    runner = threading.Thread(target=lambda: box.append(stream_all(server.url, started)))
    runner.start()
    assert started.wait(90), "the streams never started"
    pid = server.pids[victim]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    runner.join(MAX_TOKENS / 10 + 200)
    results = box[0]
    print(f"\nSTALL {victim}: {len(results)} sent, {sum(r.finish == 'length' for r in results)} completed, "
          f"{sum(r.error is not None for r in results)} errors, "
          f"stream pause max {max(r.max_gap for r in results):.2f}s")
    assert [r.error for r in results] == [None] * len(results), server.log()
    assert [r.finish for r in results] == ["length"] * len(results)
    assert all(r.max_gap >= PAUSE_S - 1 for r in results), [r.max_gap for r in results]
    assert [r.tokens for r in results] == unpaused, "a pause changed an answer"
    assert server.proc.poll() is None, "the server stopped over a pause shorter than --stall-timeout"
    leaked = pages_leaked(server.url)
    print(f"STALL {victim}: pages leaked {leaked}")
    assert leaked == 0


HANG_TOKEN = 77


@pytest.mark.parametrize("how", ["worker hangs in a forward", "scheduler is stopped"])
def test_a_process_silent_past_the_stall_timeout_is_dumped_and_the_server_stops(tiny_models, how):
    """--stall-timeout 4: the approach is logged at 50% and 80%; past it the stuck
    process's stacks reach the log (for the hung worker: a frame in the injected
    sleep, which only a real dump of that process can contain), the stream ends with
    an error instead of hanging, the supervisor exits 1, nothing is left."""
    hang = how.startswith("worker")
    env = {"FERROXMP_FAULT_INJECT": f"forward_hang_token={HANG_TOKEN}:120"} if hang else {}
    srv = ServerProcess(tiny_models["llama"], *FLAGS, "--stall-timeout", "4", env=env)
    try:
        box: list = []
        prompt = [3, HANG_TOKEN, 9] if hang else [3, 4, 9]
        # The scheduler is stopped the moment the first tokens arrive, not after a fixed
        # sleep: a fast box streams all 2000 tokens of the tiny model in under a second.
        stop = None if hang else (lambda: os.kill(srv.pids["scheduler"], signal.SIGSTOP))
        t = threading.Thread(target=lambda: box.append(
            stream_generate(srv.url, prompt, 2000, timeout=30, on_first=stop)))
        t.start()
        t0 = time.time()
        code = srv.wait_exit(30)
        t.join(30)
        log = srv.log()
        assert code != 0, log
        assert time.time() - t0 < 20, "the stall was not caught near the timeout"
        assert box and box[0].error is not None and box[0].finish != "length", box
        assert re.search(r"silent for [\d.]+s \(50% of --stall-timeout", log), log
        assert re.search(r"silent for [\d.]+s \(80% of --stall-timeout", log), log
        assert "its Python stacks follow" in log, log
        if hang:
            assert re.search(r'File ".*faults\.py", line \d+ in before_forward', log), log
        else:
            assert "state T" in log and "STOPPED" in log, log
        time.sleep(0.5)
        assert srv.leftovers() == [], log
    finally:
        srv.stop()


def test_the_frontends_stack_dump_reaches_its_bridge_thread_past_512_http_threads(tiny_models):
    """A stalled frontend is diagnosed from its stack dump (SIGUSR1, as the supervisor
    sends it), which lists the newest threads first and stops at 100: with the default
    512 HTTP threads, the bridge's receive loop (bridge.py's _run) must still be in it."""
    srv = ServerProcess(tiny_models["llama"], *FLAGS)
    try:
        os.kill(srv.pids["frontend"], signal.SIGUSR1)
        deadline = time.time() + 20
        while time.time() < deadline and "Thread 0x" not in srv.log():
            time.sleep(0.2)
        time.sleep(1.0)  # the rest of the dump
        srv.log()  # (flushes)
        with open(srv.log_path) as f:
            log = f.read()
        assert "Thread 0x" in log, log[-3000:]
        assert re.search(r'File ".*frontend/bridge\.py", line \d+ in _run', log), log[-6000:]
        assert srv.proc.poll() is None  # a dump does not stop the frontend
    finally:
        srv.stop()
