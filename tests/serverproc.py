"""`ferroxmp serve` as a real subprocess, for end-to-end tests.

`ServerProcess` picks a free port, points TMPDIR and FERROXMP_CACHE at a private
folder (so the run directory's removal can be checked), waits for /health, and
on `stop()` always leaves nothing behind: it kills what still runs and reports
any process, shared-memory segment or run-directory file that survived.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


class ServerProcess:
    def __init__(self, model: Optional[str], *flags: str, ready_timeout: float = 180.0,
                 cmd: Optional[list[str]] = None, cwd: Optional[str] = None,
                 port: Optional[int] = None, env: Optional[dict] = None) -> None:
        self.tmp = tempfile.mkdtemp(prefix="fxmp-test-")
        env = dict(os.environ, TMPDIR=self.tmp, FERROXMP_CACHE=os.path.join(self.tmp, "cache"), **(env or {}))
        model_flags = ["--model", model] if model else []
        base = cmd or [sys.executable, "-m", "ferroxmp.cli", "serve"]
        self.log_path = os.path.join(self.tmp, "server.log")
        self.headers = _auth_headers(list(flags))  # /server_info needs the key when one is set
        # free_port's port is free when asked, not when the server binds it: another test's
        # server (or router) can take it between. Then another process answers on it (seen:
        # a router's 502s); try again on a new port, twice at most.
        for attempt in range(3):
            self.port = port or free_port()
            self._log = open(self.log_path, "a")
            port_flags = [] if port else ["--port", str(self.port)]  # an explicit port: the default
            self.proc = subprocess.Popen(base + model_flags + port_flags + list(flags),
                                         stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
            self.url = f"http://127.0.0.1:{self.port}"
            self.info: dict = {}
            try:
                if self._wait_ready(ready_timeout):
                    return
                if port or attempt == 2:
                    raise RuntimeError(f"another server answers on port {self.port}:\n{self.log()}")
            except BaseException:
                self.stop()
                raise
            self.stop()

    def _wait_ready(self, timeout: float) -> bool:
        """Wait until the port answers; True if it is this server that answers (its
        supervisor is self.proc or one of its descendants), False if another does."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    info = requests.get(self.url + "/server_info", headers=self.headers, timeout=5).json()
                    if not self._descends(info.get("processes", {}).get("supervisor")):
                        return False
                    self.info = info
                    return True
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.05)  # every test waits here for its server: poll often
        raise TimeoutError(f"server not healthy within {timeout}s:\n{self.log()}")

    def _descends(self, pid: Optional[int]) -> bool:
        """pid is self.proc's or a descendant's (a wrapper script may run the supervisor)."""
        while pid and pid > 1:
            if pid == self.proc.pid:
                return True
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return False
        return False

    @property
    def pids(self) -> dict[str, int]:
        p = self.info["processes"]
        return {"frontend": p["frontend"], "scheduler": p["scheduler"], "worker": p["workers"][0]}

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-6000:]

    def leftovers(self) -> list[str]:
        """Whatever outlived the server: processes, /dev/shm segments, run-dir files."""
        left = [f"{name} pid {pid}" for name, pid in (self.pids.items() if self.info else []) if pid_alive(pid)]
        left += glob.glob(f"/dev/shm/fxmp_{self.proc.pid}_*")
        left += [p for p in glob.glob(os.path.join(self.tmp, "ferroxmp-*"))]
        return left

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for name, pid in (self.pids.items() if self.info else []):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for seg in glob.glob(f"/dev/shm/fxmp_{self.proc.pid}_*"):
            os.unlink(seg)
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _auth_headers(flags: list[str]) -> dict:
    """The Authorization header for --api-key, or the first key of --api-key-file."""
    key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
    if "--api-key-file" in flags:
        with open(flags[flags.index("--api-key-file") + 1]) as f:
            line = next(x.strip() for x in f if x.strip() and not x.startswith("#"))
        key = line.partition(":")[2] or line
    return {"Authorization": f"Bearer {key}"} if key else {}


def stream_lines(resp: requests.Response):
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            data = line[6:]
            yield data if data == b"[DONE]" else json.loads(data)


@dataclass
class StreamResult:
    """One streamed /generate request as the client saw it."""
    status: int
    tokens: list
    finish: Optional[str] = None
    error: Optional[str] = None  # an SSE error event, a non-200 body or a connection failure
    max_gap: float = 0.0  # longest wait between two events (the stream's worst pause)
    done: bool = False  # [DONE] arrived


def stream_generate(url: str, ids: list, max_tokens: int, timeout: float = 60.0,
                    on_first: Optional[Callable[[], object]] = None, **sampling) -> StreamResult:
    """Stream a greedy (unless told otherwise) /generate request to its end, timing the
    gaps; `on_first` is called once the first tokens arrived (its wait is not a gap)."""
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **sampling}
    try:
        resp = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": params,
                                                      "stream": True}, stream=True, timeout=(10, timeout))
        if resp.status_code != 200:
            return StreamResult(resp.status_code, [], error=resp.text)
        res = StreamResult(200, [])
        last = time.monotonic()
        for ev in stream_lines(resp):
            now = time.monotonic()
            res.max_gap, last = max(res.max_gap, now - last), now
            if ev == b"[DONE]":
                res.done = True
            elif "error" in ev:
                res.error = str(ev["error"])
            else:
                res.tokens.extend(ev["output_ids"])
                res.finish = ev.get("finish_reason") or res.finish
                if on_first is not None and res.tokens:
                    on_first()
                    on_first, last = None, time.monotonic()
        return res
    except requests.RequestException as e:
        return StreamResult(0, [], error=f"{type(e).__name__}: {e}")


def metric(url: str, name: str, headers: Optional[dict] = None) -> float:
    for line in requests.get(url + "/metrics", headers=headers, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def pages_leaked(url: str, timeout: float = 30.0, headers: Optional[dict] = None) -> int:
    """Once idle: every page held by no row and no tree entry must be free; any other is
    a leak (the radix contract's accounting, read from the scheduler's own Stats)."""
    deadline = time.time() + timeout
    while metric(url, "ferroxmp_requests_running", headers) or metric(url, "ferroxmp_requests_waiting", headers):
        assert time.time() < deadline, "the server never went idle"
        time.sleep(0.3)
    time.sleep(1.2)  # a fresh Stats heartbeat
    total, free = metric(url, "ferroxmp_kv_pages_total", headers), metric(url, "ferroxmp_kv_pages_free", headers)
    return int(total - free - metric(url, "ferroxmp_kv_pages_cached", headers))


@contextlib.contextmanager
def serving(model: Optional[str], *flags: str, **kw):
    """A ServerProcess for a fixture: always stopped, and it must leave nothing behind
    (process, shared memory, run directory) — checked once here for every test file."""
    srv = ServerProcess(model, *flags, **kw)
    try:
        yield srv
    finally:
        srv.stop()
    assert not srv.leftovers(), srv.log()


def greedy_ids(srv: "ServerProcess", prompts: dict, max_tokens: int) -> dict:
    """{key: output ids} of one greedy /generate request per prompt of token ids, each
    exactly max_tokens long (ignore_eos)."""
    got = {}
    for key, ids in prompts.items():
        res = requests.post(srv.url + "/generate", headers=srv.headers, timeout=120, json={
            "input_ids": ids, "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}})
        assert res.status_code == 200, res.text
        got[key] = res.json()["output_ids"]
    return got


def greedy_completion(srv: "ServerProcess", prompt: str, max_tokens: int) -> str:
    """The text of one greedy /v1/completions request (raises on an HTTP error)."""
    r = requests.post(srv.url + "/v1/completions", headers=srv.headers, timeout=120,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]
