#!/usr/bin/env python3
"""A quiet ModelRunner's one-row decode beside background processes that wake, compute a
little and sleep (what a served step has around it: the scheduler, the frontend, the
supervisor, the client), alternated with no background, round by round.

Why: a served single stream takes 5-20% longer a step than the same step in a quiet
process (docs/BENCHMARKS.md 33), while the serving processes use ~3% of the machine's
CPU. On a 2-core box the step's two threads meet at ~300 barriers a step, so a thread
that loses its core for a moment holds the other one; this measures what a given
background costs the step, without the serving code in the way.

A load is PERIOD_MS:BUSY_MS[:COUNT[:POLICY]]: COUNT processes (1), each sleeping
PERIOD_MS then spinning BUSY_MS, under POLICY: "normal", "nice" (nice 19) or "idle"
(SCHED_IDLE: runs only on an idle core).

    .venv/bin/python tools/bench_interference.py --model /tmp/smollm2-f32 \\
        --load 27:0.25:3 --load 27:0.25:3:idle [--rounds 6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_floor_served import RunnerTokens  # noqa: E402

WAKER = """
import os, sys, time
period, busy, policy = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, sys.argv[3]
if policy == "nice":
    os.nice(19)
elif policy == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    time.sleep(period)
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
"""


def start(load: str) -> list[subprocess.Popen]:
    period, busy, *rest = load.split(":")
    count, policy = int(rest[0]) if rest else 1, rest[1] if len(rest) > 1 else "normal"
    if policy not in ("normal", "nice", "idle"):
        sys.exit(f"unknown policy {policy!r} in --load {load}")
    return [subprocess.Popen([sys.executable, "-c", WAKER, period, busy, policy]) for _ in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", default="none")
    p.add_argument("--load", action="append", default=[], help="PERIOD_MS:BUSY_MS[:COUNT[:POLICY]]; repeatable")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--decode-steps", type=int, default=4, help="steps a call (the server's --decode-steps)")
    p.add_argument("--input-len", type=int, default=80)
    p.add_argument("--output-len", type=int, default=128)
    a = p.parse_args()
    modes = ["quiet"] + a.load
    ms: dict[str, list[float]] = {m: [] for m in modes}
    rt = RunnerTokens(a.model, a.quantization, a.decode_steps, a.input_len + a.output_len + 16)
    try:
        for r in range(a.rounds):
            for mode in modes:
                procs = [] if mode == "quiet" else start(mode)
                try:
                    time.sleep(0.3)  # the wakers running
                    ms[mode].append(rt.time(a.input_len, a.output_len) * 1e3)
                finally:
                    for proc in procs:
                        proc.kill()
                        proc.wait()
            print(f"round {r + 1}: " + ", ".join(f"{m} {v[-1]:.2f}" for m, v in ms.items()), flush=True)
    finally:
        rt.close()
    quiet = statistics.median(ms["quiet"])
    for m, v in ms.items():
        print(f"{m:>24}: median {statistics.median(v):6.2f} ms a token ({statistics.median(v) / quiet:.3f}x quiet), "
              f"rounds {' '.join(f'{x:.2f}' for x in v)}")


if __name__ == "__main__":
    main()
