#!/usr/bin/env python3
"""A served single stream's time a token beside the machine's read floor, measured in
the same minutes (issue 29: "within 1.1x of the bandwidth floor").

Job: against a running server (or several, alternated: an A/B of flags in the same
minutes), alternate a read probe and one streamed request, ROUNDS times. The probe reads
a buffer of the bytes a one-row decode step must read (every weight once, from the
file's headers as the loader will hold them, plus the row's K/V at its mean context) in
2 MiB pages, as the worker's weights are, the fastest of several ways (read_floor.py);
its median time is that minute's read floor. Each request's TPOT (its own usage: tokens after the first over the time after
the first) is set against the mean of the probes on either side of it.

Why alternate within a run: this box's read bandwidth moves by 20% between minutes
(23-29 GB/s in docs/BENCHMARKS.md 32), more than the gap being measured.

    tools/bench_floor_served.py --base-url http://127.0.0.1:31009 --model /tmp/smollm2-f32 \
        --dtype float32 --rounds 6 --input-len 64 --output-len 128
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_client import Target, discover_model, settled_counters, stream_request  # noqa: E402
from read_floor import ReadFloor  # noqa: E402


class RunnerTokens:
    """The model in a ModelRunner here (tools/bench_worker.py's RunnerBench, one row):
    a prompt of n random tokens prefilled, then `out` tokens decoded `steps` a call."""

    def __init__(self, model: str, quantization: str, steps: int, max_len: int):
        from bench_worker import RunnerBench
        self.rb = RunnerBench(model, 1, max_len + steps, 16, False, "auto", quantization=quantization,
                              decode_steps=steps)
        self.steps = steps
        self.g = random.Random(0)

    def close(self) -> None:
        self.rb.close()

    def time(self, n: int, out: int) -> float:
        """Seconds a token after the first call's (as TPOT leaves out the first token)."""
        vocab = self.rb.runner.config.vocab_size
        self.rb.start({0: [self.g.randrange(3, vocab) for _ in range(n)]})
        calls, t0 = out // self.steps, 0.0
        for c in range(calls):
            if c == 1:
                t0 = time.perf_counter()
            self.rb.decode(self.steps)
        return (time.perf_counter() - t0) / ((calls - 1) * self.steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", action="append", required=True,
                   help="a running server; two or more are alternated request by request")
    p.add_argument("--model", required=True, help="the checkpoint the server serves (for its bytes)")
    p.add_argument("--dtype", default="float32", help="the server's --dtype")
    p.add_argument("--quantization", default="none", help="the server's --quantization")
    p.add_argument("--kv-cache-dtype", default="auto", help="the server's --kv-cache-dtype")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--input-len", type=int, default=64, help="words in each prompt")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--probes", type=int, default=5, help="reads a way of reading, its median taken")
    p.add_argument("--seed", type=int, default=62)
    p.add_argument("--runner-steps", type=int, default=0,
                   help="also time the same tokens in a ModelRunner in this process (the checkpoint's own "
                        "dtype), N steps a call (the server's --decode-steps), after each round: the step "
                        "without serving")
    p.add_argument("--json", help="write the rounds here")
    a = p.parse_args(argv)

    import torch
    from ferroxmp.gpu_worker.loader import load_config, weight_bytes
    weights = weight_bytes(a.model, getattr(torch, a.dtype), a.quantization)
    per_pos = load_config(a.model, a.dtype, a.kv_cache_dtype).kv_bytes_per_token()
    targets = [Target(f"server{j}" if len(a.base_url) > 1 else "server", url, discover_model(url, 30.0))
               for j, url in enumerate(a.base_url)]
    rng = random.Random(a.seed)
    words = "the of and to in is was for on that with as by at from it an be this are".split()

    def prompt() -> list[dict]:
        return [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(a.input_len))}]

    # The buffer is sized for the longest context the rounds reach; a probe reads the
    # part a step at the request's mean context reads, the fastest way (read_floor.py).
    floor_probe = ReadFloor(weights + per_pos * (2 * a.input_len + 32 + a.output_len))

    def probe(nbytes: int) -> float:
        return floor_probe.seconds(nbytes, a.probes)[0]

    for t in targets:  # warm-up
        stream_request(t.base_url, "chat", t.body("chat", prompt(), 16, 0.0), 120.0)
    rows: dict[str, list[dict]] = {t.name: [] for t in targets}
    runner = RunnerTokens(a.model, a.quantization, a.runner_steps, 2 * a.input_len + 32 + a.output_len) \
        if a.runner_steps else None
    if runner:
        rows["runner"] = []
    try:
        before = probe(weights + per_pos * (a.input_len + a.output_len // 2))
        busy = "ferroxmp_worker_busy_seconds_total"
        for i in range(a.rounds):
            msgs = prompt()  # every server gets the round's prompt
            for t in targets:
                c0 = settled_counters(t.base_url)
                res = stream_request(t.base_url, "chat", t.body("chat", msgs, a.output_len, 0.0), 300.0)
                if not res.ok or res.tpot is None:
                    print(f"round {i} {t.name}: failed: {res.error}", file=sys.stderr)
                    return 1
                # The worker's time in steps a token after the first (its busy seconds less
                # the first token's wait, taken as prefill's): TPOT beyond it is spent
                # outside the steps (round trips, the other processes' turns).
                c1 = settled_counters(t.base_url)
                step = (c1[busy] - c0[busy] - res.ttft) / (res.completion_tokens - 1) if busy in c0 and busy in c1 else float("nan")
                nbytes = weights + per_pos * (res.prompt_tokens + res.completion_tokens // 2)
                after = probe(nbytes)
                floor = (before + after) / 2
                before = after
                rows[t.name].append({"tpot_ms": 1000 * res.tpot, "step_ms": 1000 * step, "floor_ms": 1000 * floor,
                                     "gb_s": nbytes / floor / 1e9, "ratio": res.tpot / floor,
                                     "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens})
                print(f"round {i} {t.name}: TPOT {1000 * res.tpot:7.2f} ms (worker's steps {1000 * step:6.2f}), "
                      f"read floor {1000 * floor:7.2f} ms ({nbytes / floor / 1e9:.1f} GB/s, {nbytes / 1e6:.0f} MB), "
                      f"TPOT / floor {res.tpot / floor:.3f}", flush=True)
            if runner:
                per_token = runner.time(rows[targets[-1].name][-1]["prompt_tokens"], a.output_len)
                after = probe(nbytes)
                floor = (before + after) / 2
                before = after
                rows["runner"].append({"tpot_ms": 1000 * per_token, "step_ms": 1000 * per_token,
                                       "floor_ms": 1000 * floor, "ratio": per_token / floor})
                print(f"round {i} runner: a token {1000 * per_token:7.2f} ms ({a.runner_steps} steps a call), read floor "
                      f"{1000 * floor:7.2f} ms, runner / floor {per_token / floor:.3f}", flush=True)
    finally:  # the runner's page pool is shared memory: removed however the rounds end
        if runner:
            runner.close()
    for name, rs in rows.items():
        ratios = [r["ratio"] for r in rs]
        where = next((t.base_url for t in targets if t.name == name), "in this process")
        print(f"{name} ({where}): median TPOT "
              f"{statistics.median(r['tpot_ms'] for r in rs):.2f} ms (steps {statistics.median(r['step_ms'] for r in rs):.2f}), "
              f"median read floor {statistics.median(r['floor_ms'] for r in rs):.2f} ms, TPOT / floor median "
              f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
