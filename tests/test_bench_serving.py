"""Unit tests of tools/bench_serving.py that need no model server.

They pin down the statistics (percentiles, TTFT, ITL, TPOT from known
timestamps), the workload generators (shared prefixes really shared, multi-turn
really resends the conversation), the request bodies each dialect gets, and the
SSE client against a stub server in a thread. The last tests run the tool
against a real `ferroxmp serve` on the tiny llama and check its token totals
against the server's own Prometheus counters, an independent count.
"""
from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from serverproc import ServerProcess

_PATH = Path(__file__).resolve().parents[1] / "tools" / "bench_serving.py"
_spec = importlib.util.spec_from_file_location("bench_serving", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = bench  # dataclasses resolve annotations through it
_spec.loader.exec_module(bench)


def test_percentiles_agree_with_the_standard_librarys_inclusive_quantiles():
    """Linear interpolation between closest ranks is what statistics.quantiles(method='inclusive')
    computes; an off-by-one in the rank would differ on most of 99 cut points."""
    rng = random.Random(7)
    for size in (2, 3, 10, 57):
        data = [rng.uniform(0, 100) for _ in range(size)]
        cuts = statistics.quantiles(data, n=100, method="inclusive")
        for q in range(1, 100):
            assert bench.percentile(data, q) == pytest.approx(cuts[q - 1], rel=1e-12, abs=1e-12)
        assert bench.percentile(data, 50) == pytest.approx(statistics.median(data))
        assert bench.percentile(data, 0) == min(data) and bench.percentile(data, 100) == max(data)


def test_a_single_value_is_every_percentile_and_no_values_give_none():
    assert bench.percentile([4.0], 99) == 4.0
    assert bench.stats_ms([]) == {"mean": None, "median": None, "p99": None, "max": None}
    assert bench.stats_ms([0.004]) == {"mean": 4.0, "median": 4.0, "p99": 4.0, "max": 4.0}


def test_ttft_itl_tpot_and_e2e_come_from_the_timestamps_and_the_usage_count():
    """Known timestamps: TTFT is first chunk minus send, ITL every gap between chunks, TPOT divides
    the post-first-token time by usage's completion tokens minus one (not by the chunk count)."""
    r = bench.RequestResult(start=10.0, end=10.9, chunk_times=[10.2, 10.3, 10.5, 10.8],
                            completion_tokens=7, prompt_tokens=5)
    assert r.ok
    assert r.ttft == pytest.approx(0.2)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(0.9)
    assert r.tpot == pytest.approx((0.9 - 0.2) / 6)


def test_tpot_is_undefined_below_two_tokens_or_without_usage():
    one = bench.RequestResult(start=0.0, end=1.0, chunk_times=[0.5], completion_tokens=1)
    unknown = bench.RequestResult(start=0.0, end=1.0, chunk_times=[0.5, 0.7])
    assert one.tpot is None and unknown.tpot is None


def test_summary_leaves_failures_out_and_counts_tokens_only_from_usage():
    """A failed request must not enter latencies; a completed one without usage adds no tokens."""
    good = bench.RequestResult(start=0.0, end=1.0, chunk_times=[0.1, 0.4, 1.0],
                               prompt_tokens=10, completion_tokens=3, cached_tokens=4)
    no_usage = bench.RequestResult(start=0.0, end=2.0, chunk_times=[0.3, 2.0])
    failed = bench.RequestResult(start=0.0, end=9.0, chunk_times=[8.0], error="HTTP 500: boom")
    s = bench.summarize([good, no_usage, failed], duration=2.0)
    assert (s["completed"], s["failed"], s["no_usage"]) == (2, 1, 1)
    assert (s["prompt_tokens"], s["completion_tokens"], s["cached_tokens"]) == (10, 3, 4)
    assert s["output_throughput"] == pytest.approx(1.5)
    assert s["total_throughput"] == pytest.approx(6.5)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)  # (100 + 300) / 2, the failed 8000 left out
    assert s["itl_ms"]["median"] == pytest.approx(600.0)  # gaps 300, 600, 1700
    assert s["tpot_ms"]["mean"] == pytest.approx(450.0)  # only `good` has usage


def test_ttft_splits_into_cold_and_warm_by_the_share_of_the_prompt_served_from_cache():
    """Warm means at least half the prompt was cached; a server that reports no cached_tokens
    (the peer) puts nothing on either side rather than everything on the cold one."""
    cold = bench.RequestResult(0.0, 1.0, [0.5, 1.0], "", 100, 2, cached_tokens=48)
    warm = bench.RequestResult(0.0, 1.0, [0.1, 1.0], "", 100, 2, cached_tokens=50)
    silent = bench.RequestResult(0.0, 1.0, [0.9, 1.0], "", 100, 2)
    assert (cold.warm, warm.warm, silent.warm) == (False, True, None)
    s = bench.summarize([cold, warm, silent], duration=1.0)
    assert s["ttft_cold_ms"]["mean"] == pytest.approx(500.0)
    assert s["ttft_warm_ms"]["mean"] == pytest.approx(100.0)


def test_the_comparison_table_shows_a_over_b_ratios():
    a = bench.summarize([bench.RequestResult(0.0, 1.0, [0.2, 1.0], "", 4, 2)], duration=1.0)
    b = bench.summarize([bench.RequestResult(0.0, 1.0, [0.5, 1.0], "", 4, 2)], duration=4.0)
    rows = {line.split("  ")[0]: line.split() for line in bench.format_table({"A": a, "B": b}).splitlines()}
    assert rows["output tokens/s"][-3:] == ["2.00", "0.50", "4.000"]
    assert rows["TTFT mean (ms)"][-1] == "0.400"


def test_random_lengths_stay_within_the_spread_and_the_seed_fixes_the_prompts():
    jobs = bench.random_jobs(random.Random(3), 200, input_len=100, output_len=20, range_ratio=0.5)
    assert all(50 <= len(j.questions[0].split()) <= 150 for j in jobs)
    assert all(10 <= j.output_lens[0] <= 30 for j in jobs)
    assert len({j.output_lens[0] for j in jobs}) > 5
    again = bench.random_jobs(random.Random(3), 200, input_len=100, output_len=20, range_ratio=0.5)
    assert [j.questions for j in jobs] == [j.questions for j in again]
    fixed = bench.random_jobs(random.Random(3), 5, input_len=64, output_len=8, range_ratio=0.0)
    assert all(len(j.questions[0].split()) == 64 and j.output_lens == [8] for j in fixed)


def _bodies_sent(job, endpoint, reply=lambda i: f"reply number {i}", fail_at=None):
    """Run a job against a fake server that records each body and answers `reply(i)`."""
    sent = []

    def send(body):
        i = len(sent)
        sent.append(body)
        error = "HTTP 503: busy" if i == fail_at else None
        return bench.RequestResult(0.0, 1.0, [0.5], reply(i), 3, 2, error=error)

    target = bench.Target("A", "http://x", "m")
    results = bench.run_job(job, endpoint, lambda p, n: target.body(endpoint, p, n, 0.0), send)
    return sent, results


def test_shared_prefix_prompts_really_share_their_groups_system_prompt():
    """Every prompt of a group starts with the same system text, groups differ, and the
    shuffled order still interleaves groups (else the cache would only ever see one)."""
    jobs = bench.shared_prefix_jobs(random.Random(1), num_groups=3, prompts_per_group=4,
                                    system_prompt_len=50, question_len=6, output_len=5)
    assert len(jobs) == 12
    systems = {g: {j.system for j in jobs if j.group == g} for g in range(3)}
    assert all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == 3
    assert [j.group for j in jobs] != sorted(j.group for j in jobs)
    for job in jobs:
        (completion,), _ = _bodies_sent(job, "completions")
        assert completion["prompt"].startswith(job.system + "\n\n")
        assert completion["prompt"].endswith(job.questions[0])
        (chat,), _ = _bodies_sent(job, "chat")
        assert chat["messages"] == [{"role": "system", "content": job.system},
                                    {"role": "user", "content": job.questions[0]}]


def test_cycled_prefixes_are_each_reused_once_per_round_in_the_same_order():
    """N distinct prefixes, then the same N again in the same order, `rounds` times: a shuffled
    or grouped order would let an LRU pool keep a prefix until its reuse, which is not the
    worst case this workload exists to measure. The questions after the prefix all differ."""
    jobs = bench.cycle_prefix_jobs(random.Random(4), num_prefixes=5, prefix_len=30, rounds=3,
                                   question_len=6, output_len=4)
    assert len(jobs) == 15
    firsts = [j.system for j in jobs[:5]]
    assert len(set(firsts)) == 5 and all(len(s.split()) == 30 for s in firsts)
    assert [j.system for j in jobs] == firsts * 3
    assert [j.group for j in jobs] == list(range(5)) * 3
    assert len({j.questions[0] for j in jobs}) == 15 and all(j.output_lens == [4] for j in jobs)
    args = bench.parse_args(["--workload", "cycle-prefixes", "--num-prefixes", "5", "--prefix-len", "30",
                             "--cycle-rounds", "3", "--question-len", "6", "--output-len", "4", "--seed", "4"])
    assert [j.system for j in bench.build_jobs(args)] == firsts * 3


def test_each_multi_turn_request_resends_the_whole_conversation_so_far():
    """Turn k must carry user 1, the server's reply 1, ..., user k, in order, with the replies
    the server actually gave; a generator that sent only the last question would fail here."""
    (job,) = bench.multi_turn_jobs(random.Random(2), 1, num_turns=4, input_len=8, output_len=6,
                                   range_ratio=0.0)
    sent, results = _bodies_sent(job, "chat")
    assert len(sent) == 4 and all(r.ok for r in results)
    for k, body in enumerate(sent):
        expected = []
        for i in range(k):
            expected += [{"role": "user", "content": job.questions[i]},
                         {"role": "assistant", "content": f"reply number {i}"}]
        expected.append({"role": "user", "content": job.questions[k]})
        assert body["messages"] == expected
        assert body["max_tokens"] == job.output_lens[k]


def test_a_conversation_stops_at_its_first_failed_turn():
    (job,) = bench.multi_turn_jobs(random.Random(2), 1, 4, 8, 6, 0.0)
    sent, results = _bodies_sent(job, "chat", fail_at=1)
    assert len(sent) == 2 and not results[-1].ok


def test_poisson_arrivals_are_all_at_once_for_inf_and_average_one_over_rate_otherwise():
    assert bench.poisson_arrivals(random.Random(0), 5, float("inf")) == [0.0] * 5
    times = bench.poisson_arrivals(random.Random(0), 4001, 20.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.05, rel=0.06)  # ~4 standard errors
    assert statistics.stdev(gaps) == pytest.approx(0.05, rel=0.1)  # exponential: sd == mean


def test_each_dialect_asks_for_exact_output_lengths_in_its_own_words():
    """openai servers get ignore_eos + include_usage; transformers serve rejects unknown fields
    with 422, so it gets EOS disabled through generation_config instead; null extra keys drop."""
    openai = bench.Target("A", "u", "m").body("completions", "hi", 9, 0.0)
    assert openai["ignore_eos"] is True and openai["max_tokens"] == 9 and openai["stream"] is True
    assert openai["stream_options"] == {"include_usage": True} and openai["prompt"] == "hi"
    hf = bench.Target("B", "u", "m", "transformers", {"stream_options": None, "seed": 1})
    body = hf.body("chat", [{"role": "user", "content": "hi"}], 9, 0.0)
    assert "ignore_eos" not in body and "stream_options" not in body and body["seed"] == 1
    assert json.loads(body["generation_config"])["eos_token_id"] == -1


class _StubSSE(BaseHTTPRequestHandler):
    """Streams a chat reply in chunked encoding with 40 ms between content chunks."""
    protocol_version = "HTTP/1.1"
    GAP = 0.04

    def log_message(self, *args):
        pass

    def _chunk(self, data: bytes):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):  # /metrics, keyed as a server started with --api-key keys it
        ok = self.path == "/metrics" and self.headers.get("Authorization") == "Bearer sesame"
        payload = (b"# TYPE ferroxmp_generation_tokens counter\nferroxmp_generation_tokens_total 42.0\n"
                   b"# TYPE ferroxmp_kv_tier_hit_tokens counter\n"
                   b'ferroxmp_kv_tier_hit_tokens_total{tier="disk"} 7.0\n'
                   b"# TYPE ferroxmp_kv_tier_bytes gauge\n"
                   b'ferroxmp_kv_tier_bytes{tier="disk"} 9.0\n') if ok else b"{}"
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["model"] == "missing":
            payload = b'{"error": {"message": "no such model"}}'
            self.send_response(404)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n')
        for piece in ("Hel", "lo", " there"):
            time.sleep(self.GAP)
            self._chunk(b'data: {"choices": [{"delta": {"content": "%s"}}]}\n\n' % piece.encode())
        if body["model"] == "breaks":
            self._chunk(b'data: {"error": "worker died"}\n\n')
        else:
            usage = {"prompt_tokens": 11, "completion_tokens": 3,
                     "prompt_tokens_details": {"cached_tokens": 8}}
            self._chunk(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")


@pytest.fixture
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubSSE)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_the_client_timestamps_each_content_chunk_as_it_arrives(stub_url):
    """The role-only chunk is no token; usage comes from the last chunk even with no choices; and
    each gap is the server's 40 ms, which a client that buffered the body would report as ~0."""
    body = bench.Target("A", stub_url, "m").body("chat", [{"role": "user", "content": "x"}], 3, 0.0)
    r = bench.stream_request(stub_url, "chat", body, timeout=10)
    assert r.ok, r.error
    assert r.text == "Hello there" and len(r.chunk_times) == 3
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (11, 3, 8)
    assert all(gap >= 0.03 for gap in r.itl)
    assert r.ttft >= 0.03 and r.e2e >= r.ttft


def test_the_bench_tools_send_the_servers_key_with_every_request_and_metrics_read(stub_url, monkeypatch):
    """A server started with --api-key answers 401 to /metrics without the key: the tools
    read no counters at all and reported nothing (issue 25). --api-key sets the variable."""
    monkeypatch.setenv(bench.API_KEY_ENV, "")  # undone after the test, whatever parse_args sets
    client = sys.modules["bench_client"]
    assert client.scrape_counters(stub_url) == {}
    bench.parse_args(["--api-key", "sesame"])
    # Labelled counters (the per-tier hits) keep their labels; labelled gauges stay out.
    assert client.scrape_counters(stub_url) == {"ferroxmp_generation_tokens_total": 42.0,
                                                'ferroxmp_kv_tier_hit_tokens_total{tier="disk"}': 7.0}


def test_http_errors_and_error_events_fail_the_request(stub_url):
    missing = bench.stream_request(stub_url, "chat", {"model": "missing"}, timeout=10)
    assert not missing.ok and missing.error.startswith("HTTP 404")
    broken = bench.stream_request(stub_url, "chat", {"model": "breaks"}, timeout=10)
    assert not broken.ok and "worker died" in broken.error
    refused = bench.stream_request("http://127.0.0.1:9", "chat", {"model": "m"}, timeout=2)
    assert not refused.ok


# ---- against the real server --------------------------------------------------------

def _metrics(url: str) -> dict[str, float]:
    """Unlabelled ferroxmp_* samples of /metrics (counters and gauges)."""
    text = requests.get(url + "/metrics", timeout=5).text
    return {name: float(value) for name, _, value in
            (line.partition(" ") for line in text.splitlines() if line.startswith("ferroxmp_"))
            if "{" not in name}


def _settled_metrics(url: str, timeout: float = 20.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and two reads a heartbeat apart agree: the
    scheduler publishes its counters with a heartbeat (>= 1/s), so one read may lag."""
    deadline = time.monotonic() + timeout
    last = _metrics(url)
    while time.monotonic() < deadline:
        time.sleep(1.1)
        now = _metrics(url)
        if now == last and now["ferroxmp_requests_running"] == 0 and now["ferroxmp_requests_waiting"] == 0:
            return now
        last = now
    raise TimeoutError(f"/metrics did not settle within {timeout}s: {last}")


@pytest.fixture(scope="module")
def ferroxmp_server(tiny_models):
    server = ServerProcess(tiny_models["llama"], "--page-size", "4", "--kv-pages", "1024")
    try:
        yield server
    finally:
        server.stop()
        left = server.leftovers()
        assert not left, f"left behind after stop: {left}"


def _run_tool(url: str, tmp_path, *argv: str) -> tuple[dict, dict, dict]:
    """(tool report, /metrics before, /metrics after), both reads settled."""
    before = _settled_metrics(url)
    out = tmp_path / "report.json"
    assert bench.main(["--base-url", url, "--out", str(out), "--timeout", "60", *argv]) == 0
    after = _settled_metrics(url)
    return json.loads(out.read_text()), before, after


def _usage_total(records: list[dict], key: str) -> int:
    return sum(r[key] or 0 for r in records)


@pytest.mark.timeout(120)
def test_the_tools_token_totals_equal_the_servers_own_counters(ferroxmp_server, tmp_path):
    """The tool's prompt/completion totals (usage, warmup included via the report's warmup
    records) must equal the growth of the scheduler's counters, and the completion total must
    be exactly the seeded output lengths (ignore_eos). A client that double-counted a usage
    chunk, dropped the last one, or summed the wrong field would miss by whole requests."""
    url = ferroxmp_server.url
    argv = ["--workload", "random", "--num-prompts", "12", "--input-len", "40", "--output-len", "12",
            "--range-ratio", "0.5", "--max-concurrency", "4", "--seed", "5", "--warmup", "1"]
    report, before, after = _run_tool(url, tmp_path, *argv)
    summary, warmup = report["summaries"]["A"], report["warmup"]["A"]
    assert (summary["completed"], summary["failed"], summary["no_usage"]) == (12, 0, 0)
    assert len(warmup) == 1 and warmup[0]["ok"]
    grew = {k: after[k] - before[k] for k in after}
    assert grew["ferroxmp_prompt_tokens_total"] == summary["prompt_tokens"] + _usage_total(warmup, "prompt_tokens")
    assert grew["ferroxmp_generation_tokens_total"] == (summary["completion_tokens"]
                                                        + _usage_total(warmup, "completion_tokens"))
    expected_out = sum(n for job in bench.build_jobs(bench.parse_args(argv)) for n in job.output_lens)
    assert summary["completion_tokens"] == expected_out
    # The tool's own /metrics reading (rounds only, no warmup) agrees with the usage totals.
    assert summary["server"]["ferroxmp_prompt_tokens_total"] == summary["prompt_tokens"]
    assert summary["server"]["ferroxmp_generation_tokens_total"] == summary["completion_tokens"]
    assert "ferroxmp_kv_pages_total" not in summary["server"]  # a gauge, though named *_total
    assert 0 < summary["worker_busy_share"] <= 1.0
    # CPU seconds per process come from /proc via /server_info's pids: all named, the worker busy.
    assert set(summary["cpu_s"]) == {"frontend", "scheduler", "worker", "client"}
    assert summary["cpu_s"]["worker"] > 0


@pytest.mark.timeout(120)
def test_a_shared_prefix_run_shows_cache_hits_on_the_servers_counters(ferroxmp_server, tmp_path):
    """Groups sharing a 64-word system prompt, sent one at a time: every request after a
    group's first must adopt the shared pages, so the server's cached-token counter grows by
    what the replies' usage reported, and the tool sees both cold and warm first tokens."""
    url = ferroxmp_server.url
    report, before, after = _run_tool(
        url, tmp_path, "--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "4",
        "--system-prompt-len", "64", "--question-len", "8", "--output-len", "6",
        "--max-concurrency", "1", "--seed", "9", "--warmup", "1", "--no-server-metrics")
    summary, warmup = report["summaries"]["A"], report["warmup"]["A"]
    assert (summary["completed"], summary["failed"]) == (8, 0)
    grew = {k: after[k] - before[k] for k in after}
    assert grew["ferroxmp_prompt_tokens_total"] == summary["prompt_tokens"] + _usage_total(warmup, "prompt_tokens")
    assert grew["ferroxmp_generation_tokens_total"] == (summary["completion_tokens"]
                                                        + _usage_total(warmup, "completion_tokens"))
    cached = grew["ferroxmp_cached_prompt_tokens_total"]
    assert cached == summary["cached_tokens"] + _usage_total(warmup, "cached_tokens")
    # 6 warm requests, each adopting at least the page-aligned 64-word prefix (>= 1 token/word).
    assert cached >= 6 * 60
    requests_ = report["requests"]["A"]
    assert sum(1 for r in requests_ if r["cached_tokens"] * 2 < r["prompt_tokens"]) == 2  # a group's first
    assert summary["ttft_cold_ms"]["mean"] is not None and summary["ttft_warm_ms"]["mean"] is not None


@pytest.mark.timeout(90)
def test_the_restart_tool_finds_the_prompt_on_disk_after_a_restart(tiny_models, tmp_path, monkeypatch):
    """tools/bench_kv_restart.py end to end on the tiny llama: cold finds nothing, warm finds
    the pool, and the request after the SIGTERM restart must adopt the prompt's whole pages
    (its usage's cached_tokens and the disk-tier hit counter): with a disk tier that saved or
    loaded nothing, both would be 0."""
    monkeypatch.setenv("FERROXMP_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("bench_kv_restart", _PATH.parent / "bench_kv_restart.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "restart.json"
    assert tool.main(["--prompt-tokens", "200", "--ready-timeout", "60", "--timeout", "60", "--json", str(out),
                      "--", "--model", tiny_models["llama"], "--kv-cache-dir", str(tmp_path / "kv")]) == 0
    r = json.loads(out.read_text())
    assert r["cold"]["prompt_tokens"] == 200 and r["cold"]["cached_tokens"] == 0
    assert r["warm"]["cached_tokens"] > 0
    assert r["after_restart"]["cached_tokens"] > 0
    assert r["server"]["disk_hit_tokens"] == r["after_restart"]["cached_tokens"]
    assert r["server"]["kv_load_seconds_count"] >= 1 and r["server"]["kv_loaded_bytes_total"] > 0
    assert r["page_files"] > 0 and r["plain_read_first"]["bytes"] == r["page_file_bytes"]
