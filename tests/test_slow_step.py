"""A slow step is not a stall, and steps shrink to the time target (real processes).

Measured before this: a step longer than --stall-timeout (a big chunk on an
emulated-bf16 CPU) read as a stall; the supervisor tore the server down and every
client got 503. Here the worker is made slow on purpose (FERROXMP_FAULT_INJECT): one
prompt's step burns 2x the stall timeout of CPU, and every token costs 1 ms more.
Oracles: the server must still be running and answer; the greedy tokens must equal
an in-process unbounded run (LocalEngine, one chunk per prompt); the step time the
worker reported for a one-token request (/stats: busy seconds over steps, every
step a prefill chunk) must stay near --max-step-seconds, which a 1,500-token prompt in one chunk would exceed 5x.
"""
from __future__ import annotations

import time

import requests

from engine import LocalEngine
from serverproc import metric, pages_leaked, serving, stream_generate

BUSY_TOKEN, BUSY_S, STALL_S, TARGET_S = 5, 6.0, 3.0, 0.3
FAULTS = f"forward_busy_token={BUSY_TOKEN}:{BUSY_S};forward_busy_per_token=0.001"
FLAGS = ("--page-size", "4", "--kv-pages", "1024", "--max-running-requests", "8", "--max-model-len", "2048",
         "--stall-timeout", str(STALL_S), "--max-step-seconds", str(TARGET_S))
LONG = [(13 * i + 5) % 900 + 10 for i in range(1500)]
TIMED = [(11 * i + 7) % 900 + 10 for i in range(1500)]
WARM = [(7 * i + 3) % 900 + 10 for i in range(300)]


def _unbounded(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    eng = LocalEngine(model, num_pages=1024, page_size=4, max_batch_tokens=2048, max_model_len=2048)
    try:
        return [eng.generate(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    finally:
        eng.close()


def _stats(url: str) -> dict:
    time.sleep(1.2)  # a fresh Stats heartbeat (one at least every 0.5 s)
    return requests.get(url + "/stats", timeout=10).json()


def test_a_step_twice_the_stall_timeout_finishes_and_long_prompts_prefill_in_timed_chunks(tiny_models):
    """One server, two behaviours of the same slow worker:
    1. a prompt holding BUSY_TOKEN makes one step compute for 2x --stall-timeout: the
       server must not be torn down, the client gets its full greedy answer and the log
       says the worker was computing (before, the supervisor stopped with 'stalled');
    2. after a warm-up, a 1,500-token prompt is prefilled in chunks: the average step
       lasts under 2x --max-step-seconds (one chunk would take ~1.5 s = 5x), the budget
       in /metrics is below --max-batch-tokens, and the tokens equal the unbounded run."""
    model = tiny_models["llama"]
    busy_prompt = [3, BUSY_TOKEN, 9, 11]
    want = _unbounded(model, [busy_prompt, WARM, LONG], 8) + _unbounded(model, [TIMED], 1)
    with serving(model, *FLAGS, env={"FERROXMP_FAULT_INJECT": FAULTS}) as srv:
        t0 = time.monotonic()
        slow = stream_generate(srv.url, busy_prompt, 8, timeout=60)
        assert slow.error is None and slow.tokens == want[0], (slow, srv.log())
        assert time.monotonic() - t0 >= BUSY_S, "the injected slow step did not happen"
        assert srv.proc.poll() is None, "the server stopped over a slow step"
        assert "is computing" in srv.log() and "stalled" not in srv.log(), srv.log()

        assert stream_generate(srv.url, WARM, 8, timeout=60).tokens == want[1]
        long = stream_generate(srv.url, LONG, 8, timeout=120)
        assert long.error is None and long.tokens == want[2], long
        before = _stats(srv.url)  # one token: every step of this request is a prefill chunk
        assert stream_generate(srv.url, TIMED, 1, timeout=120).tokens == want[3]
        after = _stats(srv.url)
        steps = after["steps"] - before["steps"]
        per_step = (after["worker_busy_seconds"] - before["worker_busy_seconds"]) / steps
        budget = metric(srv.url, "ferroxmp_step_token_budget")
        print(f"\nSLOW STEP: {steps} steps, {per_step:.2f}s per step, budget {budget:.0f} tokens")
        assert steps >= 3, f"a 1,500-token prompt in {steps} steps: not chunked"
        assert per_step < 2 * TARGET_S, per_step
        assert 16 <= budget < 2048, budget
        assert pages_leaked(srv.url) == 0
