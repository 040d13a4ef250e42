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
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

# Short common words: most BPE vocabularies give " word" one token, so a prompt of
# N words is roughly N tokens. The report uses the server's count, not N.
WORDS = (
    "the of and to in is was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do "
    "will each about how up out them then she many some so these would other into has "
    "more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words "
    "called just where most know get through back much before go good new write our "
    "used me man too any day same right look think also around another came come work "
    "three must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every"
).split()


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, num_words)))


def spread(rng: random.Random, length: int, ratio: float) -> int:
    """A length drawn uniformly from [length*(1-ratio), length*(1+ratio)], at least 1."""
    low, high = int(length * (1 - ratio)), int(math.ceil(length * (1 + ratio)))
    return max(1, rng.randint(low, high))


@dataclass
class Job:
    """What one client sends in order: one turn, or every turn of a conversation."""
    questions: list[str]
    output_lens: list[int]
    system: str | None = None
    group: int = 0


def random_jobs(rng: random.Random, num_prompts: int, input_len: int, output_len: int,
                range_ratio: float) -> list[Job]:
    return [Job([random_text(rng, spread(rng, input_len, range_ratio))],
                [spread(rng, output_len, range_ratio)]) for _ in range(num_prompts)]


def shared_prefix_jobs(rng: random.Random, num_groups: int, prompts_per_group: int,
                       system_prompt_len: int, question_len: int, output_len: int) -> list[Job]:
    """Groups of prompts that share one long system prompt, shuffled so groups interleave."""
    jobs = []
    for group in range(num_groups):
        system = random_text(rng, system_prompt_len)
        jobs += [Job([random_text(rng, question_len)], [output_len], system, group)
                 for _ in range(prompts_per_group)]
    rng.shuffle(jobs)
    return jobs


def multi_turn_jobs(rng: random.Random, num_conversations: int, num_turns: int,
                    input_len: int, output_len: int, range_ratio: float) -> list[Job]:
    return [Job([random_text(rng, spread(rng, input_len, range_ratio)) for _ in range(num_turns)],
                [spread(rng, output_len, range_ratio) for _ in range(num_turns)], group=c)
            for c in range(num_conversations)]


def poisson_arrivals(rng: random.Random, count: int, rate: float) -> list[float]:
    """Send offsets in seconds: exponential gaps at `rate` per second; all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * count
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(math.floor(pos))
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class RequestResult:
    """Timestamps (perf_counter seconds) and the server's usage for one request."""
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def warm(self) -> bool | None:
        """Whether the prefix cache served at least half the prompt; None if the server does not say."""
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return 2 * self.cached_tokens >= self.prompt_tokens

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None below two tokens or without usage."""
        if not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """Mean, median, p99 and max in milliseconds; None each when there is nothing to measure."""
    ms = [v * 1000.0 for v in values]
    if not ms:
        return {"mean": None, "median": None, "p99": None, "max": None}
    return {"mean": sum(ms) / len(ms), "median": percentile(ms, 50), "p99": percentile(ms, 99),
            "max": max(ms)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Aggregate metrics over the completed requests of one or more rounds lasting `duration` s."""
    done = [r for r in results if r.ok]
    with_usage = [r for r in done if r.completion_tokens is not None]
    out_tokens = sum(r.completion_tokens for r in with_usage)
    in_tokens = sum(r.prompt_tokens or 0 for r in with_usage)
    cached = [r.cached_tokens for r in with_usage if r.cached_tokens is not None]
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "no_usage": len(done) - len(with_usage), "duration_s": duration,
        "prompt_tokens": in_tokens, "completion_tokens": out_tokens,
        "cached_tokens": sum(cached) if cached else None,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "ttft_cold_ms": stats_ms([r.ttft for r in done if r.warm is False]),
        "ttft_warm_ms": stats_ms([r.ttft for r in done if r.warm]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([g for r in done for g in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in done]),
    }


@dataclass
class Target:
    """One server under test and how to phrase requests for it."""
    name: str
    base_url: str
    model: str
    dialect: str = "openai"  # "transformers": no ignore_eos field, EOS disabled via generation_config
    extra_body: dict = field(default_factory=dict)

    def body(self, endpoint: str, prompt: str | list[dict], max_tokens: int, temperature: float) -> dict:
        body = {"model": self.model, "stream": True, "max_tokens": max_tokens,
                "temperature": temperature, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        body["messages" if endpoint == "chat" else "prompt"] = prompt
        if self.dialect == "transformers":
            # transformers serve answers 422 to unknown fields; eos_token_id -1 is its "no EOS".
            del body["ignore_eos"]
            body["generation_config"] = json.dumps({"eos_token_id": -1, "do_sample": False})
        for key, value in self.extra_body.items():
            if value is None:
                body.pop(key, None)
            else:
                body[key] = value
        return body


def stream_request(base_url: str, endpoint: str, body: dict, timeout: float) -> RequestResult:
    """POST one streaming request and timestamp every SSE chunk that carries text."""
    url = urlsplit(base_url.rstrip("/"))
    path = url.path + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(url.hostname, url.port, timeout=timeout)
    result = RequestResult(start=time.perf_counter())
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status // 100 != 2:
            result.error = f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}"
            return result
        while line := resp.readline():  # readline returns as soon as one SSE line is in
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if "error" in event:
                result.error = f"stream error: {event['error']}"
                break
            for choice in event.get("choices") or []:
                piece = choice.get("text") if endpoint == "completions" else (choice.get("delta") or {}).get("content")
                if piece:
                    result.chunk_times.append(now)
                    result.text += piece
            if usage := event.get("usage"):
                result.prompt_tokens = usage.get("prompt_tokens")
                result.completion_tokens = usage.get("completion_tokens")
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if result.error is None and not result.chunk_times:
            result.error = "no content in the stream"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter()
        conn.close()
    return result


def run_job(job: Job, endpoint: str, make_body, send) -> list[RequestResult]:
    """Send a job's turns in order; on chat, each turn resends the whole conversation so far."""
    history: list[dict] = [{"role": "system", "content": job.system}] if job.system else []
    results = []
    for question, output_len in zip(job.questions, job.output_lens):
        if endpoint == "chat":
            history.append({"role": "user", "content": question})
            prompt = list(history)
        else:
            prompt = f"{job.system}\n\n{question}" if job.system else question
        result = send(make_body(prompt, output_len))
        results.append(result)
        if not result.ok:
            break  # the rest of this conversation would resend a broken history
        history.append({"role": "assistant", "content": result.text})
    return results


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


def scrape_counters(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    """The unlabelled `ferroxmp_*` counters of GET /metrics (gauges such as kv_pages_total
    left out); {} for a server without them."""
    url = urlsplit(base_url.rstrip("/"))
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("GET", url.path + "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace") if resp.status == 200 else ""
    except (OSError, http.client.HTTPException):
        return {}
    finally:
        conn.close()
    lines = text.splitlines()
    counters = {line.split()[2] for line in lines if line.startswith("# TYPE ") and line.endswith(" counter")}
    out = {}
    for line in lines:
        name, _, value = line.partition(" ")  # labelled samples ("name{...} v") never match below
        if name.startswith("ferroxmp_") and (name in counters or  # TYPE names it with or without _total
                                             name.endswith("_total") and name[:-len("_total")] in counters):
            out[name] = float(value)
    return out


def settled_counters(base_url: str, gap: float = 1.1, limit: float = 15.0) -> dict[str, float]:
    """Counters once two reads `gap` s apart agree: the scheduler publishes them with its
    heartbeat (at least once a second), so a single read right after a round may lag."""
    deadline = time.monotonic() + limit
    last = scrape_counters(base_url)
    while last and time.monotonic() < deadline:
        time.sleep(gap)
        now = scrape_counters(base_url)
        if now == last:
            break
        last = now
    return last


def settled_sum(urls: list[str]) -> dict[str, float]:
    """Settled counters of several servers (the backends behind a router), summed by name."""
    out: dict[str, float] = {}
    for url in urls:
        for k, v in settled_counters(url).items():
            out[k] = out.get(k, 0.0) + v
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


def process_cpu(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    """CPU seconds (user + system) so far of a local ferroxmp's processes, named as in
    GET /server_info, read from /proc; {} for a remote server or one without /server_info."""
    url = urlsplit(base_url.rstrip("/"))
    if url.hostname not in ("127.0.0.1", "localhost", "::1"):
        return {}
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("GET", url.path + "/server_info")
        resp = conn.getresponse()
        procs = json.loads(resp.read())["processes"] if resp.status == 200 else {}
        pids = {"frontend": procs["frontend"], "scheduler": procs["scheduler"]}
        pids.update({f"worker{i}" if i else "worker": pid for i, pid in enumerate(procs["workers"])})
        out = {}
        for name, pid in pids.items():
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
            out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        return out
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
        return {}
    finally:
        conn.close()


def discover_model(base_url: str, timeout: float) -> str:
    """The first model id of GET /v1/models; exits with a clear message if there is none."""
    url = urlsplit(base_url.rstrip("/"))
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("GET", url.path + "/v1/models")
        return json.loads(conn.getresponse().read())["data"][0]["id"]
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as exc:
        sys.exit(f"cannot list the models of {base_url} ({type(exc).__name__}: {exc}); "
                 "is the server up? pass --model/--compare-model to skip the lookup")
    finally:
        conn.close()


ROWS = [("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
        ("no_usage", "no usage in reply", "{:.0f}"), ("duration_s", "duration (s)", "{:.2f}"),
        ("prompt_tokens", "prompt tokens (usage)", "{:.0f}"),
        ("completion_tokens", "completion tokens (usage)", "{:.0f}"),
        ("cached_tokens", "cached prompt tokens", "{:.0f}"),
        ("request_throughput", "requests/s", "{:.3f}"),
        ("output_throughput", "output tokens/s", "{:.2f}"),
        ("total_throughput", "total tokens/s", "{:.2f}"),
        ("worker_busy_share", "worker busy / wall (/metrics)", "{:.3f}"),
        ("server_cache_hit_rate", "cached / prompt tokens (/metrics)", "{:.3f}")]
ROWS += [(f"cpu_s.{p}", f"CPU s, {p}", "{:.1f}") for p in ("worker", "scheduler", "frontend", "client")]
ROWS += [(f"{m}_ms.{s}", f"{m.upper()} {s} (ms)", "{:.2f}")
         for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "median", "p99")]
# TTFT split by cache hit (warm: at least half the prompt was cached); "-" where the server
# reports no cached_tokens or no request fell on that side.
_AFTER_TTFT = ROWS.index(("ttft_ms.p99", "TTFT p99 (ms)", "{:.2f}")) + 1
ROWS[_AFTER_TTFT:_AFTER_TTFT] = [("ttft_ms.max", "TTFT max (ms)", "{:.2f}")] + [(f"ttft_{k}_ms.{s}", f"TTFT {k} {s} (ms)", "{:.2f}")
                                 for k in ("cold", "warm") for s in ("mean", "median")]


def lookup(summary: dict, key: str):
    for part in key.split("."):
        summary = summary.get(part) if isinstance(summary, dict) else None
    return summary


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def format_table(summaries: dict[str, dict]) -> str:
    names = list(summaries)
    headers = ["metric"] + names + (["A/B"] if len(names) == 2 else [])
    rows = []
    for key, label, fmt in ROWS:
        values = [lookup(summaries[n], key) for n in names]
        cells = [fmt.format(v) if isinstance(v, (int, float)) else "-" for v in values]
        if len(names) == 2:
            r = ratio(*values)
            cells.append(f"{r:.3f}" if r is not None else "-")
        rows.append([label] + cells)
    widths = [max(len(str(row[i])) for row in rows + [headers]) for i in range(len(headers))]
    line = lambda row: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                 for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([line(headers), "-" * (sum(widths) + 2 * len(widths) - 2)] + [line(r) for r in rows])


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
    if args.workload == "multi-turn":
        return multi_turn_jobs(rng, args.num_conversations, args.num_turns,
                               args.input_len, args.output_len, args.range_ratio)
    return random_jobs(rng, args.num_prompts, args.input_len, args.output_len, args.range_ratio)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
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
    p.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn"), default="random")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths spread over [L(1-r), L(1+r)]")
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=5)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
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
