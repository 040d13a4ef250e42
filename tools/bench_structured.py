#!/usr/bin/env python3
"""The throughput cost of structured output: a batch of N concurrent requests constrained
by a JSON schema (`response_format: json_schema`) against the same batch unconstrained,
on one running server, alternating batch by batch (U, C, U, C, ...) so drift hits both.

    python tools/bench_structured.py --base-url http://127.0.0.1:8080 --concurrency 32 \
        --max-tokens 128 --rounds 3

Invariants:
- Both batches do the same work: the same prompts, seeds and max_tokens, and every row
  runs to max_tokens. The unconstrained rows send `ignore_eos`; the schema (an array with
  `minItems` beyond what max_tokens can hold) never lets a constrained row end early. A
  row that stopped early anyway is reported (`short_rows`), never hidden.
- Token counts come from the server's `usage`, never from the client's guess.
- A constrained reply must begin as the schema says (`[{"name": "`); one that does not
  means the constraint was not applied, and the run fails.
- The first constrained batch compiles the schema (then cached by the server); a warm-up
  batch of each kind runs before the measured rounds and is reported apart.
- A local server's CPU seconds per batch (its processes, from /proc, via
  bench_serving.process_cpu) are reported beside the wall clock: on a shared machine the
  CPU cost per token moves less than the wall time does.
- Standard library only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from bench_serving import process_cpu  # tools/ is on sys.path when run as a script (and bench_serving puts it there)
from bench_client import API_KEY_ENV, headers  # noqa: E402

WORDS = ("the of and to in is was for on are as with his they at be this from have or by one had not "
         "but what all were when we there can an your which their said if do will each about how up "
         "out them then she many some so these would other into has more her two like him see time").split()


def schema(min_items: int) -> dict:
    """Records with a short string, an integer in [0, 999] and a short string array: keys, strings,
    digits and brackets in turn, so the mask changes shape every few tokens."""
    record = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 999},
                             "tags": {"type": "array", "maxItems": 3,
                                      "items": {"type": "string", "maxLength": 8}}}}
    return {"type": "array", "minItems": min_items, "items": record}


CONSTRAINED_PREFIX = '[{"name": "'


@dataclass
class Batch:
    kind: str  # "unconstrained" | "constrained"
    wall_s: float
    completion_tokens: int
    short_rows: int  # rows that ended before max_tokens
    server_cpu: dict | None = None  # CPU seconds per server process; None for a remote server

    @property
    def server_cpu_s(self) -> float | None:
        return None if self.server_cpu is None else sum(self.server_cpu.values())

    @property
    def tok_per_s(self) -> float:
        return self.completion_tokens / self.wall_s

    @property
    def cpu_ms_per_tok(self) -> float | None:
        return None if self.server_cpu_s is None else 1000 * self.server_cpu_s / self.completion_tokens


def post(base: str, body: dict, timeout: float) -> dict:
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers({"Content-Type": "application/json"}))
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def bodies(args, model: str, constrained: bool) -> list[dict]:
    rng = random.Random(args.seed)  # the same prompts for both kinds
    out = []
    for i in range(args.concurrency):
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.input_len))
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": args.temperature, "seed": args.seed + i}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "records", "schema": schema(args.max_tokens)}}
        else:
            body["ignore_eos"] = True
        out.append(body)
    return out


def run_batch(args, model: str, constrained: bool) -> Batch:
    reqs = bodies(args, model, constrained)
    cpu0 = process_cpu(args.base_url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(reqs)) as pool:
        replies = list(pool.map(lambda b: post(args.base_url, b, args.timeout), reqs))
    wall = time.perf_counter() - t0
    cpu1 = process_cpu(args.base_url)
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0} if cpu0 and cpu1.keys() == cpu0.keys() else None
    tokens = short = 0
    for r in replies:
        n = r["usage"]["completion_tokens"]
        tokens += n
        short += n < args.max_tokens
        if constrained and not r["choices"][0]["text"].startswith(CONSTRAINED_PREFIX):
            raise RuntimeError(f"a constrained reply does not follow the schema: {r['choices'][0]['text'][:80]!r}")
    return Batch("constrained" if constrained else "unconstrained", wall, tokens, short, cpu)


KINDS = ("unconstrained", "constrained")


def line(b: Batch) -> str:
    cpu = "" if b.server_cpu_s is None else f"  server CPU {b.server_cpu_s:6.1f} s ({b.cpu_ms_per_tok:.2f} ms/tok)"
    return (f"{b.kind:>13}: {b.wall_s:7.2f} s  {b.completion_tokens} tokens  {b.tok_per_s:8.1f} tok/s"
            f"  short rows {b.short_rows}{cpu}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", help="model name to send (default: first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in each batch, all sent at once")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in words")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=3, help="measured (unconstrained, constrained) pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", help="write every batch as JSON")
    p.add_argument("--api-key", default=None, help=f"the server's --api-key (default: ${API_KEY_ENV})")
    args = p.parse_args(argv)
    if args.api_key:
        os.environ[API_KEY_ENV] = args.api_key
    model = args.model
    if model is None:
        u = urlsplit(args.base_url)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
        conn.request("GET", "/v1/models", headers=headers())
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
    warm = [run_batch(args, model, False), run_batch(args, model, True)]
    for b in warm:
        print(f"warm-up {line(b)}" + ("  (includes the schema's compile)" if b.kind == "constrained" else ""))
    batches: list[Batch] = []
    for r in range(args.rounds):
        for constrained in (False, True):
            batches.append(run_batch(args, model, constrained))
            print(f"round {r + 1} {line(batches[-1])}")
    pairs = list(zip(batches[0::2], batches[1::2]))
    med = {k: statistics.median(b.tok_per_s for b in batches if b.kind == k) for k in KINDS}
    ratios = [c.tok_per_s / u.tok_per_s for u, c in pairs]
    print(f"\n{args.concurrency} requests x {args.max_tokens} tokens, {args.rounds} rounds:")
    print(f"  output tok/s (median): unconstrained {med['unconstrained']:.1f}, constrained "
          f"{med['constrained']:.1f}; ratio of medians {med['constrained'] / med['unconstrained']:.3f}")
    print(f"  per-round ratio constrained/unconstrained: median {statistics.median(ratios):.3f} "
          f"({', '.join(f'{x:.3f}' for x in ratios)})")
    if all(b.cpu_ms_per_tok is not None for b in batches):
        cpu = {k: statistics.median(b.cpu_ms_per_tok for b in batches if b.kind == k) for k in KINDS}
        cpu_ratios = [c.cpu_ms_per_tok / u.cpu_ms_per_tok for u, c in pairs]
        print(f"  server CPU ms per output token (median): unconstrained {cpu['unconstrained']:.2f}, "
              f"constrained {cpu['constrained']:.2f}; per-round ratio median {statistics.median(cpu_ratios):.3f} "
              f"({', '.join(f'{x:.3f}' for x in cpu_ratios)})")
        for proc in batches[0].server_cpu:
            per = {k: statistics.median(1000 * b.server_cpu[proc] / b.completion_tokens for b in batches
                                        if b.kind == k) for k in KINDS}
            print(f"    {proc:>9}: unconstrained {per['unconstrained']:.2f}, constrained {per['constrained']:.2f} ms/tok")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "warmup": [vars(b) for b in warm],
                       "batches": [vars(b) for b in batches], "median_tok_per_s": med,
                       "per_round_ratio": ratios}, f, indent=1)
    return 1 if any(b.short_rows for b in batches) else 0


if __name__ == "__main__":
    sys.exit(main())
