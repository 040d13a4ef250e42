"""The client side of tools/bench_serving.py: one streamed request and its timestamps
(`RequestResult`), how to phrase a request for each server (`Target`), and what a
ferroxmp server tells about itself (/metrics counters, its processes' CPU time).
Standard library only."""
from __future__ import annotations

import http.client
import json
import os
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from bench_workloads import Job

API_KEY_ENV = "FERROXMP_API_KEY"  # read by every request here; bench_serving's --api-key sets it


def headers(extra: dict | None = None) -> dict:
    """Request headers, with the server's key as a bearer token when one is set: a server
    started with --api-key refuses /v1 and /metrics without it."""
    out = dict(extra or {})
    if key := os.environ.get(API_KEY_ENV):
        out["Authorization"] = f"Bearer {key}"
    return out

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
        conn.request("POST", path, json.dumps(body), headers({"Content-Type": "application/json"}))
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


def scrape_counters(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    """The `ferroxmp_*` counters of GET /metrics, labelled ones keyed with their labels
    (gauges such as kv_pages_total left out); {} for a server without them."""
    url = urlsplit(base_url.rstrip("/"))
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("GET", url.path + "/metrics", headers=headers())
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
        # A labelled sample keeps its labels in the key: 'name_total{tier="disk"}'.
        sample, _, value = line.rpartition(" ")
        name = sample.partition("{")[0]
        if name.startswith("ferroxmp_") and (name in counters or  # TYPE names it with or without _total
                                             name.endswith("_total") and name[:-len("_total")] in counters):
            out[sample] = float(value)
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
        conn.request("GET", url.path + "/v1/models", headers=headers())
        return json.loads(conn.getresponse().read())["data"][0]["id"]
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as exc:
        sys.exit(f"cannot list the models of {base_url} ({type(exc).__name__}: {exc}); "
                 "is the server up? pass --model/--compare-model to skip the lookup")
    finally:
        conn.close()
