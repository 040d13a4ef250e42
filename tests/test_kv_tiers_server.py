"""KV tiers through real servers: `ferroxmp serve` processes, HTTP, SIGTERM and kill -9.

The oracle is the cold answer: the same prompt under another `cache_salt` (nothing is
shared across salts, in memory or on disk), or the first server's answer. A tier that
returns a wrong page changes the greedy tokens of a random-weight model at once.
"""
from __future__ import annotations

import glob
import os
import signal
import time

import numpy as np
import pytest
import requests

from serverproc import ServerProcess, metric, pages_leaked

FLAGS = ("--max-batch-tokens", "128", "--max-step-seconds", "0")


def complete(srv: ServerProcess, ids: list[int], salt: str = "", max_tokens: int = 8, headers=None) -> tuple[list, int]:
    """(generated token ids, prompt tokens served from the cache) of a greedy request."""
    body = {"model": srv.info["model"], "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "cache_salt": salt}
    r = requests.post(srv.url + "/v1/completions", json=body, timeout=120, headers=headers or srv.headers)
    assert r.status_code == 200, r.text
    out = r.json()
    tokens = out["choices"][0]["logprobs"]["tokens"]
    return tokens, out["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt(seed: int, n: int = 300) -> list[int]:
    return np.random.default_rng(seed).integers(10, 250, n).tolist()


def hits(srv: ServerProcess, tier: str) -> float:
    time.sleep(1.2)  # a fresh Stats heartbeat
    return metric(srv.url, f'ferroxmp_kv_tier_hit_tokens_total{{tier="{tier}"}}', srv.headers)


def test_a_sigterm_restart_keeps_the_cache_warm_from_disk(tiny_models, tmp_path):
    """The first request after a restart adopts the prompt from the disk tier and gives
    the first server's tokens; another tenant's salt finds nothing on disk."""
    kv = str(tmp_path / "kv")
    ids = prompt(1)
    with ServerProcess(tiny_models["llama"], "--kv-cache-dir", kv, *FLAGS) as first:
        want, cached = complete(first, ids, salt="a")
        assert cached == 0
        assert first.info["worker_info"]["kv_tiers"]["disk_dir"].startswith(kv)
    files = glob.glob(os.path.join(kv, "*", "*.kv"))
    # prompt + the 7 generated tokens whose KV was computed (the 8th never ran)
    assert len(files) == (300 + 7) // 16, "every whole published page is on disk after a SIGTERM"
    assert oct(os.stat(os.path.dirname(files[0])).st_mode & 0o777) == "0o700"
    with ServerProcess(tiny_models["llama"], "--kv-cache-dir", kv, *FLAGS) as second:
        got, cached = complete(second, ids, salt="a")
        assert got == want, "pages loaded from disk must give the first server's tokens"
        assert cached == 288, "every whole page below the last token is adopted after the restart"
        assert hits(second, "disk") == 288
        other, cached_b = complete(second, ids, salt="b")
        assert cached_b == 0, "another salt must not find tenant a's pages on disk"
        assert other == want
        assert pages_leaked(second.url, headers=second.headers) == 0


def test_kill_9_mid_write_leaves_a_directory_the_next_server_reads_or_drops(tiny_models, tmp_path):
    """Killed with -9 (supervisor and children) while pages are being written: the next
    server starts, drops what is torn, and answers like a cold server."""
    kv = str(tmp_path / "kv")
    ids = prompt(2, 900)
    srv = ServerProcess(tiny_models["llama"], "--kv-cache-dir", kv, *FLAGS, "--max-model-len", "1024")
    try:
        r = requests.post(srv.url + "/v1/completions", json={"model": srv.info["model"], "prompt": ids,
                          "max_tokens": 4, "temperature": 0, "stream": True}, stream=True, timeout=60)
        next(r.iter_lines())  # prefill has started publishing pages
        for pid in [srv.proc.pid] + list(srv.pids.values()):
            os.kill(pid, signal.SIGKILL)
        srv.proc.wait(10)
    finally:
        srv.stop()
    with ServerProcess(tiny_models["llama"], "--kv-cache-dir", kv, *FLAGS, "--max-model-len", "1024") as again:
        assert not glob.glob(os.path.join(kv, "*", "*.tmp")), "unfinished writes are removed at start"
        got, _ = complete(again, ids, salt="x")
        want, cold = complete(again, ids, salt="cold-oracle")
        assert cold == 0 and got == want


def test_pages_evicted_to_the_host_tier_come_back_with_the_same_answer(tiny_models):
    """A pool of 48 pages, four 300-token prompts: the first is evicted to host memory,
    then loaded back when it is asked again."""
    with ServerProcess(tiny_models["llama"], "--kv-host-gb", "0.05", "--kv-pages", "48", *FLAGS) as srv:
        ids = prompt(3)
        want, _ = complete(srv, ids)
        for seed in (4, 5, 6):
            complete(srv, prompt(seed))
        got, cached = complete(srv, ids)
        assert got == want
        assert cached == 288 and hits(srv, "host") > 0
        assert pages_leaked(srv.url, headers=srv.headers) == 0


def test_cache_flush_needs_the_admin_key_and_empties_every_tier(tiny_models, tmp_path):
    kv = str(tmp_path / "kv")
    admin = {"Authorization": "Bearer admin-secret"}
    with ServerProcess(tiny_models["llama"], "--kv-cache-dir", kv, "--api-key", "user-key",
                       "--admin-api-key", "admin-secret", *FLAGS) as srv:
        ids = prompt(7)
        complete(srv, ids)
        assert requests.post(srv.url + "/cache/flush", headers=srv.headers, timeout=10).status_code == 401
        deadline = time.time() + 10
        while not glob.glob(os.path.join(kv, "*", "*.kv")) and time.time() < deadline:
            time.sleep(0.1)
        r = requests.post(srv.url + "/cache/flush", headers=admin, timeout=30)
        assert r.status_code == 200 and r.json()["flushed"] is True
        deadline = time.time() + 10
        while glob.glob(os.path.join(kv, "*", "*.kv")) and time.time() < deadline:
            time.sleep(0.1)
        assert not glob.glob(os.path.join(kv, "*", "*.kv")), "the disk tier is emptied"
        _, cached = complete(srv, ids)
        assert cached == 0, "nothing is cached after a flush"
        text = requests.get(srv.url + "/metrics", headers=srv.headers, timeout=10).text
        for name in ("ferroxmp_kv_load_seconds_bucket", "ferroxmp_kv_store_seconds_bucket",
                     "ferroxmp_kv_store_queue_depth", "ferroxmp_kv_disk_usage_bytes", 'ferroxmp_kv_tier_bytes{tier="disk"}'):
            assert name in text, name
