#!/usr/bin/env python3
"""Restart scenario for the KV disk tier: cold, warm and after-restart TTFT of one long prompt.

Usage: bench_kv_restart.py [--prompt-tokens 8000] [--json OUT] -- --model X --kv-cache-dir D ...

Job: start `ferroxmp serve` (its own subprocess, the args after `--`), send one long
prompt with max_tokens 1 streamed (cold), again (warm, in the pool), wait until the disk
writer is idle, SIGTERM the server, start it again with the same args, send it again
(after restart: loaded from disk). Then time a plain sequential read of the page files
this run wrote, and compare it with the server's own load rate
(ferroxmp_kv_loaded_bytes_total / ferroxmp_kv_load_seconds_sum). The page cache is
dropped before the restart (the files come from the disk: a reboot), or kept with
--keep-page-cache (a restart right after the files were written: a deploy); the load
rate is compared with the plain read in the same state.

Invariants: all three requests carry one fresh cache_salt, so a directory left by an
earlier run cannot make the cold request warm; only page files new since the start are
measured; the server is always stopped (SIGTERM, then kill) before the tool exits.
Standard library only.
"""
from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_client import discover_model, headers  # noqa: E402
from bench_workloads import random_text  # noqa: E402


def _http(url: str, method: str, path: str, body=None, timeout: float = 30.0):
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     headers({"Content-Type": "application/json"}))
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def metrics(url: str) -> dict[str, float]:
    """Every ferroxmp_* sample of /metrics, labels kept in the key."""
    _, text = _http(url, "GET", "/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith("ferroxmp_"):
            sample, _, value = line.rpartition(" ")
            out[sample] = float(value)
    return out


class Server:
    """`ferroxmp serve` with the pass-through args, its log in a temporary file."""

    def __init__(self, cmd: list[str], url: str, ready_timeout: float):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-kv-restart-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = url
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log {self.log.name}")
            try:
                if _http(url, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not healthy within {ready_timeout}s; log {self.log.name}")

    def stop(self, timeout: float = 60.0) -> float:
        """SIGTERM, wait for exit (kill past `timeout`); returns the seconds it took."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return time.monotonic() - start


def first_token(url: str, model: str, ids: list[int], salt: str, timeout: float) -> dict:
    """Stream one max_tokens=1 request: seconds to the first event carrying a choice, and usage."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True,
            "ignore_eos": True, "cache_salt": salt, "stream_options": {"include_usage": True}}
    start, ttft, usage = time.perf_counter(), None, {}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers({"Content-Type": "application/json"}))
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    finally:
        conn.close()
    if ttft is None:
        raise RuntimeError("no token in the stream")
    return {"ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def build_prompt(url: str, n: int, seed: int) -> list[int]:
    """Exactly `n` token ids of random words, cut from what /tokenize gives."""
    rng, words = random.Random(seed), n
    while True:
        status, text = _http(url, "POST", "/tokenize", {"prompt": random_text(rng, words)}, timeout=120)
        if status != 200:
            raise RuntimeError(f"/tokenize: HTTP {status}: {text[:300]}")
        ids = json.loads(text)["tokens"]
        if len(ids) >= n:
            return ids[:n]
        words = int(words * 1.5) + 8


def wait_disk_idle(url: str, limit: float = 120.0) -> float:
    """Seconds until the disk writer's queue is empty and its usage stops growing."""
    start, last = time.monotonic(), None
    while time.monotonic() - start < limit:
        time.sleep(1.1)  # the scheduler's Stats heartbeat
        m = metrics(url)
        now = (m.get("ferroxmp_kv_store_queue_depth"), m.get("ferroxmp_kv_disk_usage_bytes"))
        if now[0] == 0 and now == last:
            break
        last = now
    return time.monotonic() - start


def wait_load_stats(url: str, limit: float = 10.0) -> dict[str, float]:
    """/metrics once the worker's load histogram counts a load (it reaches the scheduler's
    Stats later than the hit counter), or after `limit` s."""
    deadline = time.monotonic() + limit
    while True:
        time.sleep(1.1)  # the scheduler's Stats heartbeat
        m = metrics(url)
        if m.get("ferroxmp_kv_load_seconds_count") or time.monotonic() > deadline:
            return m


def warmup(url: str, model: str, ids: list[int], salt: str, timeout: float) -> None:
    """A short request under another salt, so neither measured request pays a fresh
    server's first-request costs (allocator, lazy imports) that the warm one does not."""
    first_token(url, model, ids[:8], "warmup-" + salt, timeout)


def drop_page_cache() -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "dropped"
    except OSError as e:
        return f"refused ({type(e).__name__}: {e.strerror or e})"


def plain_read(files: list[str]) -> dict:
    start, total = time.perf_counter(), 0
    for path in files:
        with open(path, "rb") as f:
            total += len(f.read())
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "bytes_per_s": total / seconds if seconds else None}


def page_files(kv_dir: str) -> set[str]:
    return set(glob.glob(os.path.join(kv_dir, "**", "*.kv"), recursive=True))


def _ratio(a, b):
    return a / b if a is not None and b else None


def run(args) -> dict:
    serve = list(args.serve_args)
    if "--kv-cache-dir" not in serve:
        sys.exit("pass the server's --kv-cache-dir DIR after --")
    kv_dir = serve[serve.index("--kv-cache-dir") + 1]
    if "--port" in serve:
        port = int(serve[serve.index("--port") + 1])
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve += ["--port", str(port)]
    cmd, url = args.serve_cmd.split() + serve, f"http://127.0.0.1:{port}"
    before_files, salt = page_files(kv_dir), f"bench-kv-restart-{uuid.uuid4().hex}"
    out: dict = {"prompt_tokens": args.prompt_tokens, "serve_args": serve}
    server = Server(cmd, url, args.ready_timeout)
    try:
        model = discover_model(url, 10.0)
        ids = build_prompt(url, args.prompt_tokens, args.seed)
        warmup(url, model, ids, salt, args.timeout)
        out["cold"] = first_token(url, model, ids, salt, args.timeout)
        out["warm"] = first_token(url, model, ids, salt, args.timeout)
        out["store_wait_s"] = wait_disk_idle(url)
    finally:
        out["shutdown_s"] = server.stop()
    files = sorted(page_files(kv_dir) - before_files)
    out["page_files"] = len(files)
    out["page_file_bytes"] = sum(os.path.getsize(f) for f in files)
    out["drop_caches_before_restart"] = "kept" if args.keep_page_cache else drop_page_cache()
    server = Server(cmd, url, args.ready_timeout)
    try:
        warmup(url, model, ids, salt, args.timeout)
        out["after_restart"] = first_token(url, model, ids, salt, args.timeout)
        m = wait_load_stats(url)
    finally:
        server.stop()
    load_s, loaded = m.get("ferroxmp_kv_load_seconds_sum"), m.get("ferroxmp_kv_loaded_bytes_total")
    out["server"] = {"kv_load_seconds_sum": load_s, "kv_load_seconds_count": m.get("ferroxmp_kv_load_seconds_count"),
                     "kv_loaded_bytes_total": loaded, "kv_load_failures_total": m.get("ferroxmp_kv_load_failures_total"),
                     "disk_hit_tokens": m.get('ferroxmp_kv_tier_hit_tokens_total{tier="disk"}'),
                     "load_bytes_per_s": _ratio(loaded, load_s)}
    out["drop_caches_before_read"] = drop_page_cache()
    out["plain_read_first"] = plain_read(files)  # page cache cold only if the drop worked
    out["plain_read_again"] = plain_read(files)  # page cache warm
    cold, warm, after = (out[k]["ttft_s"] for k in ("cold", "warm", "after_restart"))
    out["ratios"] = {"cold_over_restart": _ratio(cold, after), "restart_over_warm": _ratio(after, warm),
                     "load_rate_over_plain_read": _ratio(out["server"]["load_bytes_per_s"], out[
                         "plain_read_again" if args.keep_page_cache else "plain_read_first"]["bytes_per_s"])}
    return out


def table(r: dict) -> str:
    mb = lambda v: f"{v / 1e6:.1f} MB/s" if v else "-"  # noqa: E731
    f = lambda v, fmt="{:.3f}": fmt.format(v) if isinstance(v, (int, float)) else "-"  # noqa: E731
    rows = [(f"TTFT {k.replace('_', ' ')}", f"{r[k]['ttft_s'] * 1000:.1f} ms",
             f"cached {r[k]['cached_tokens']} / {r[k]['prompt_tokens']}") for k in ("cold", "warm", "after_restart")]
    rows += [("cold / after restart", f(r["ratios"]["cold_over_restart"]), ""),
             ("after restart / warm", f(r["ratios"]["restart_over_warm"]), ""),
             ("page files (this run)", f"{r['page_files']}", f"{r['page_file_bytes'] / 1e6:.2f} MB"),
             ("server load rate", mb(r["server"]["load_bytes_per_s"]),
              f"{f(r['server']['kv_load_seconds_sum'], '{:.4f}')} s over {f(r['server']['kv_load_seconds_count'], '{:.0f}')}"
              f" loads, disk hits {f(r['server']['disk_hit_tokens'], '{:.0f}')}"),
             ("plain read, first", mb(r["plain_read_first"]["bytes_per_s"]), f"drop_caches: {r['drop_caches_before_read']}"),
             ("plain read, again", mb(r["plain_read_again"]["bytes_per_s"]), "page cache warm"),
             ("load rate / plain read", f(r["ratios"]["load_rate_over_plain_read"]),
              f"page cache before restart: {r['drop_caches_before_restart']}")]
    width = max(len(a) for a, _, _ in rows)
    return "\n".join(f"{a.ljust(width)}  {b.rjust(12)}  {c}" for a, b, c in rows)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-cmd", default=f"{sys.executable} -m ferroxmp.cli serve")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=600.0, help="socket timeout per request (s)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="restart without dropping the page cache (compare with the warm plain read)")
    args = p.parse_args(argv[:split])
    args.serve_args = argv[split + 1:]
    report = run(args)
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
