#!/usr/bin/env python3
"""Load generator and latency report for any OpenAI-compatible streaming server.

Job: send a seeded workload (random, shared-prefix or multi-turn) over SSE to one
server, or to two alternately (A, B, A, B... one whole round each, so drift hits
both alike), and report TTFT, TPOT, ITL, end-to-end latency and throughput.

Invariants:
- Token counts come only from the server's `usage`; a request without usage
  counts as completed but adds no tokens (reported as `no_usage`), never a guess.
- A request is failed if it got a non-2xx status, an error event, a broken
  stream or no content at all; failed requests are left out of every latency.
- The same seed gives the same prompts and arrival times for every server and
  every round (with --new-prompts-per-round, for every server within a round);
  only the replies (resent in multi-turn) may differ.
- A ferroxmp server's own counters (/metrics) are read, settled, before and after
  each round; their deltas are reported beside the client's counts, never mixed in.
  So is the CPU time of its processes (from /proc, local servers only) and of this
  client, which shares the machine with the server it measures.
- Standard library only; matplotlib is imported only for `--plot`.

This file is the command line and the rounds; beside it `bench_workloads.py` (the
jobs), `bench_client.py` (one streamed request, a server's counters) and
`bench_report.py` (summary and table).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its modules, also when loaded by path (tests)
# Re-exported for the tests and tools/bench_structured.py, which load this file by path.
from bench_client import (API_KEY_ENV, RequestResult, Target, counter_deltas, discover_model, process_cpu,  # noqa: E402
                          run_job, settled_sum, stream_request)
from bench_report import ROWS, format_table, lookup, percentile, ratio, stats_ms, summarize  # noqa: E402,F401
from bench_workloads import (Job, copy_text_jobs, cycle_prefix_jobs, multi_turn_jobs, poisson_arrivals, random_jobs,  # noqa: E402
                             shared_prefix_jobs)


class Progress:
    """A stderr line of requests done and failed: rewritten in place on a terminal, else
    printed at most once a second (a log should not get a line per request)."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self.tty, self.last, self.shown = sys.stderr.isatty(), 0.0, (0, 0)
        self.lock = threading.Lock()

    def update(self, results: list[RequestResult]) -> None:
        with self.lock:
            self.done += len(results)
            self.failed += sum(not r.ok for r in results)
            if time.monotonic() - self.last >= (0.1 if self.tty else 1.0):
                self._show("\r" if self.tty else "\n")

    def close(self) -> None:
        if self.tty or self.shown != (self.done, self.failed):
            self._show("\n")

    def _show(self, end: str) -> None:
        self.last, self.shown = time.monotonic(), (self.done, self.failed)
        sys.stderr.write(f"{self.label}: {self.done}/{self.total} requests, {self.failed} failed{end}")
        sys.stderr.flush()


def run_round(target: Target, jobs: list[Job], arrivals: list[float], args, label: str):
    """Run every job once against `target`; returns (results, wall-clock duration)."""
    progress = Progress(label, sum(len(j.questions) for j in jobs))
    workers = min(len(jobs), args.max_concurrency or len(jobs)) or 1

    def make_body(prompt, max_tokens):
        return target.body(args.endpoint, prompt, max_tokens, args.temperature)

    def send(body):
        return stream_request(target.base_url, args.endpoint, body, args.timeout)

    def task(job):
        results = run_job(job, args.endpoint, make_body, send)
        progress.update(results)
        return results

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = []
        for job, offset in zip(jobs, arrivals):
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            futures.append(pool.submit(task, job))
        results = [r for f in futures for r in f.result()]
    progress.close()
    return results, time.perf_counter() - start


def plot(path: str, results: dict[str, list[RequestResult]]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written",
              file=sys.stderr)
        return
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rs in results.items():
        done = [r for r in rs if r.ok]
        ax_ttft.hist([r.ttft * 1000 for r in done], bins=30, alpha=0.6, label=name)
        ax_itl.hist([g * 1000 for r in done for g in r.itl], bins=50, alpha=0.6, label=name)
    for ax, title in ((ax_ttft, "TTFT (ms)"), (ax_itl, "ITL (ms)")):
        ax.set_title(title), ax.set_ylabel("count"), ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}", file=sys.stderr)


def build_jobs(args, seed: int | None = None) -> list[Job]:
    rng = random.Random(args.seed if seed is None else seed)
    if args.workload == "shared-prefix":
        return shared_prefix_jobs(rng, args.num_groups, args.prompts_per_group,
                                  args.system_prompt_len, args.question_len, args.output_len)
    if args.workload == "cycle-prefixes":  # in order: run_round submits jobs as listed
        return cycle_prefix_jobs(rng, args.num_prefixes, args.prefix_len, args.cycle_rounds,
                                 args.question_len, args.output_len)
    if args.workload == "copy-text":
        return copy_text_jobs(rng, args.num_prompts, args.input_len, args.output_len)
    if args.workload == "multi-turn":
        return multi_turn_jobs(rng, args.num_conversations, args.num_turns,
                               args.input_len, args.output_len, args.range_ratio)
    return random_jobs(rng, args.num_prompts, args.input_len, args.output_len, args.range_ratio)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None,
                   help=f"sent as a bearer token on every request and /metrics read (default: ${API_KEY_ENV})")
    p.add_argument("--model", help="model name to send (default: first of GET /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--dialect", choices=("openai", "transformers"), default="openai",
                   help="transformers: for `transformers serve`, which rejects ignore_eos")
    p.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON merged into every request body; a null value removes that key")
    p.add_argument("--compare-url", help="second server, run alternately with the first")
    p.add_argument("--compare-model")
    p.add_argument("--compare-dialect", choices=("openai", "transformers"), default="openai")
    p.add_argument("--compare-extra-body", type=json.loads, default={})
    p.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn", "cycle-prefixes", "copy-text"),
                   default="random", help="copy-text: repeat a given text (--input-len words): an input-grounded load")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths spread over [L(1-r), L(1+r)]")
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=5)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--num-prefixes", type=int, default=8, help="cycle-prefixes: distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=2048, help="cycle-prefixes: words per system prompt")
    p.add_argument("--cycle-rounds", type=int, default=3, help="cycle-prefixes: uses of each prefix, in order")
    p.add_argument("--num-conversations", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=3)
    p.add_argument("--max-concurrency", type=int, default=None, help="jobs in flight (default: no limit)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson jobs/s; inf = all at once")
    p.add_argument("--rounds", type=int, default=1, help="times the workload runs per server")
    p.add_argument("--new-prompts-per-round", action="store_true",
                   help="round k uses seed + 1000k (both servers still get the same prompts)")
    p.add_argument("--warmup", type=int, default=1, help="short requests per server before measuring")
    p.add_argument("--server-metrics-url", action="append", default=None,
                   help="read the /metrics counters from this server instead of --base-url (repeat, "
                        "summed): the backends behind a router; not with --compare-url")
    p.add_argument("--no-server-metrics", dest="server_metrics", action="store_false",
                   help="do not read ferroxmp's /metrics counters before and after each round")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="socket timeout per request (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the summaries and every request's record as JSON")
    p.add_argument("--plot", help="PNG of TTFT and ITL distributions (needs matplotlib)")
    args = p.parse_args(argv)
    if args.api_key:
        os.environ[API_KEY_ENV] = args.api_key
    if args.workload == "multi-turn" and args.endpoint != "chat":
        print("multi-turn resends the conversation as chat messages: using --endpoint chat", file=sys.stderr)
        args.endpoint = "chat"
    if args.server_metrics_url and args.compare_url:
        p.error("--server-metrics-url names the servers behind --base-url only; it cannot go with --compare-url")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    targets = [Target("A", args.base_url, args.model or discover_model(args.base_url, 10.0),
                      args.dialect, args.extra_body)]
    if args.compare_url:
        targets.append(Target("B", args.compare_url,
                              args.compare_model or discover_model(args.compare_url, 10.0),
                              args.compare_dialect, args.compare_extra_body))
    jobs = build_jobs(args)
    arrivals = poisson_arrivals(random.Random(args.seed + 1), len(jobs), args.request_rate)
    warmups = {t.name: [] for t in targets}  # kept out of the summaries, but in --out's JSON
    for target in targets:
        for _ in range(args.warmup):
            body = target.body(args.endpoint, "hello" if args.endpoint == "completions"
                               else [{"role": "user", "content": "hello"}], 4, args.temperature)
            warm = stream_request(target.base_url, args.endpoint, body, args.timeout)
            warmups[target.name].append(warm)
            if warm.error:
                print(f"warmup on {target.name} ({target.base_url}) failed: {warm.error}", file=sys.stderr)
    results = {t.name: [] for t in targets}
    durations = {t.name: 0.0 for t in targets}
    server = {t.name: {} for t in targets}  # ferroxmp's own counters, summed over rounds
    cpu = {t.name: {} for t in targets}  # CPU seconds per process over the rounds
    for rnd in range(args.rounds):
        # A new seed per round keeps a prefix cache from carrying one round's prompts into the next.
        round_jobs = build_jobs(args, args.seed + 1000 * rnd) if args.new_prompts_per_round else jobs
        for target in targets:  # A, B, A, B...: drift over time hits both servers alike
            metrics_urls = args.server_metrics_url or [target.base_url]
            before = settled_sum(metrics_urls) if args.server_metrics else {}
            cpu_before = {**process_cpu(target.base_url), "client": time.process_time()}
            rs, duration = run_round(target, round_jobs, arrivals, args, f"round {rnd + 1} {target.name}")
            cpu_after = {**process_cpu(target.base_url), "client": time.process_time()}
            results[target.name] += rs
            durations[target.name] += duration
            for k, v in counter_deltas(cpu_before, cpu_after).items():
                cpu[target.name][k] = cpu[target.name].get(k, 0.0) + v
            if before:
                for k, v in counter_deltas(before, settled_sum(metrics_urls)).items():
                    server[target.name][k] = server[target.name].get(k, 0.0) + v
    summaries = {t.name: summarize(results[t.name], durations[t.name]) for t in targets}
    for name, counters in server.items():
        summaries[name]["server"] = counters or None
        busy = counters.get("ferroxmp_worker_busy_seconds_total")
        summaries[name]["worker_busy_share"] = busy / durations[name] if busy is not None else None
        summaries[name]["server_cache_hit_rate"] = ratio(counters.get("ferroxmp_cached_prompt_tokens_total"),
                                                         counters.get("ferroxmp_prompt_tokens_total"))
        # Per tier (--kv-host-gb, --kv-cache-dir): which share of the prompt each tier served.
        summaries[name]["server_tier_hit_rate"] = {
            tier: ratio(counters.get(f'ferroxmp_kv_tier_hit_tokens_total{{tier="{tier}"}}'),
                        counters.get("ferroxmp_prompt_tokens_total")) for tier in ("pool", "host", "disk")}
        summaries[name]["cpu_s"] = cpu[name]
    for t in targets:
        print(f"{t.name}: {t.base_url}  model={t.model}  dialect={t.dialect}")
    print(f"workload={args.workload} endpoint={args.endpoint} jobs={len(jobs)} rounds={args.rounds} "
          f"rate={args.request_rate} max_concurrency={args.max_concurrency} seed={args.seed}")
    print(format_table(summaries))
    first_error = next((r.error for rs in results.values() for r in rs if r.error), None)
    if first_error:
        print(f"first error: {first_error}", file=sys.stderr)
        if "ignore_eos" in first_error:
            print("hint: `transformers serve` rejects ignore_eos: use --dialect transformers", file=sys.stderr)
    if args.out:
        config = {k: str(v) if isinstance(v, float) and math.isinf(v) else v for k, v in vars(args).items()}
        report = {"config": config, "targets": [asdict(t) for t in targets], "summaries": summaries,
                  "ratios": {k: ratio(lookup(summaries.get("A", {}), k), lookup(summaries.get("B", {}), k))
                             for k, _, _ in ROWS} if len(targets) == 2 else None,
                  "requests": {name: [asdict(r) | {"ok": r.ok} for r in rs] for name, rs in results.items()},
                  "warmup": {name: [asdict(r) | {"ok": r.ok} for r in rs] for name, rs in warmups.items()}}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if args.plot:
        plot(args.plot, results)
    return 0 if all(s["completed"] for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
