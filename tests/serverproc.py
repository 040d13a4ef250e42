"""`ferroxmp serve` as a real subprocess, for end-to-end tests.

`ServerProcess` picks a free port, points TMPDIR and FERROXMP_CACHE at a private
folder (so the run directory's removal can be checked), waits for /health, and
on `stop()` always leaves nothing behind: it kills what still runs and reports
any process, shared-memory segment or run-directory file that survived.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

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
                 port: Optional[int] = None) -> None:
        self.port = port or free_port()
        self.tmp = tempfile.mkdtemp(prefix="fxmp-test-")
        env = dict(os.environ, TMPDIR=self.tmp, FERROXMP_CACHE=os.path.join(self.tmp, "cache"))
        model_flags = ["--model", model] if model else []
        base = cmd or [sys.executable, "-m", "ferroxmp.cli", "serve"]
        self.log_path = os.path.join(self.tmp, "server.log")
        self._log = open(self.log_path, "w")
        port_flags = [] if port else ["--port", str(self.port)]  # an explicit port: the default
        self.proc = subprocess.Popen(base + model_flags + port_flags + list(flags),
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = _auth_headers(list(flags))  # /server_info needs the key when one is set
        self.info: dict = {}
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.info = requests.get(self.url + "/server_info", headers=self.headers, timeout=5).json()
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not healthy within {timeout}s:\n{self.log()}")

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
