"""`ferroxmp serve`: create the run directory, start worker → scheduler → frontend,
wait for each to report ready, watch them, and tear everything down.

Invariants: nothing outlives the supervisor — on any exit path the children are
stopped, the shared-memory pool is unlinked and the run directory (sockets,
launch.json) is removed. A child that dies takes the server down with exit 1
(in-flight clients get an error first); SIGTERM/SIGINT drains and exits 0.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

import zmq

from ferroxmp.config import ServerArgs, setup_logging
from ferroxmp.protocol import ProtocolError, Ready, Shutdown, decode, encode, endpoints

log = logging.getLogger("ferroxmp.supervisor")
READY_TIMEOUT_S = 900.0  # model loading on a slow disk
MODULES = {"worker": "ferroxmp.gpu_worker.worker", "scheduler": "ferroxmp.scheduler.scheduler",
           "frontend": "ferroxmp.frontend.server"}


class ChildDied(RuntimeError):
    pass


def unlink_segment(name: str) -> None:
    try:
        from multiprocessing import _posixshmem  # type: ignore[attr-defined]
        _posixshmem.shm_unlink("/" + name)
    except (ImportError, FileNotFoundError, OSError):
        pass


class Supervisor:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.run_dir = tempfile.mkdtemp(prefix="ferroxmp-")  # mode 0700
        self.pool_name = f"fxmp_{os.getpid()}_{secrets.token_hex(4)}"
        self.ctx = zmq.Context()
        self.ep = endpoints(self.run_dir)
        self.ready_sock = self.ctx.socket(zmq.PULL)
        self.ready_sock.bind(self.ep["supervisor"])
        self.children: dict[str, subprocess.Popen] = {}
        self.launch: dict = {"args": args.to_dict(), "pool_name": self.pool_name}
        self.signalled: Optional[int] = None

    def _write_launch(self) -> None:
        tmp = os.path.join(self.run_dir, "launch.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.launch, f)
        os.replace(tmp, os.path.join(self.run_dir, "launch.json"))

    def start(self, name: str) -> Ready:
        self._write_launch()
        self.children[name] = subprocess.Popen(
            [sys.executable, "-m", MODULES[name], "--run-dir", self.run_dir],
            start_new_session=True)  # a terminal's Ctrl-C reaches the supervisor only: it drains
        deadline = time.time() + READY_TIMEOUT_S
        while time.time() < deadline:
            self._check_children()
            if self.signalled is not None:
                raise KeyboardInterrupt
            if self.ready_sock.poll(200):
                try:
                    msg = decode(self.ready_sock.recv())
                except ProtocolError as e:
                    log.error("dropped a frame on the supervisor socket: %s", e)
                    continue
                if isinstance(msg, Ready) and msg.name == name:
                    return msg
        raise ChildDied(f"{name} did not report ready within {READY_TIMEOUT_S:.0f}s")

    def _check_children(self) -> None:
        for name, proc in self.children.items():
            rc = proc.poll()
            if rc is not None:
                raise ChildDied(f"{name} (pid {proc.pid}) exited with {rc}")

    def _on_signal(self, signum, _frame) -> None:
        self.signalled = signum
        front = self.children.get("frontend")
        if front is not None and front.poll() is None:
            front.send_signal(signal.SIGTERM)  # stop admitting now, not at the next poll

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            worker = self.start("worker")
            self.launch["worker_info"] = worker.info
            log.info("worker ready: %s", worker.info)
            self.start("scheduler")
            self.launch["pids"] = {"supervisor": os.getpid(), "scheduler": self.children["scheduler"].pid,
                                   "workers": [self.children["worker"].pid]}
            self.start("frontend")
            log.info("serving %s on http://%s:%d (OpenAI API under /v1)",
                     self.args.model_name, self.args.host, self.args.port)
            while self.signalled is None:
                self._check_children()
                time.sleep(0.2)
            return self._drain()
        except ChildDied as e:
            log.error("%s; stopping the server", e)
            self._fail_inflight(str(e))
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            self.teardown()

    def _fail_inflight(self, why: str) -> None:
        """Tell the frontend (if alive) to end every in-flight request with an error."""
        front = self.children.get("frontend")
        if front is None or front.poll() is not None:
            return
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(self.ep["frontend"])
        sock.send(encode(Shutdown(f"a server process died: {why}")))
        sock.close()
        try:
            front.wait(3)
        except subprocess.TimeoutExpired:
            pass

    def _drain(self) -> int:
        """Stop admitting, let running requests finish (the frontend owns the grace
        period), then stop the scheduler and worker."""
        log.info("draining (grace %.0fs)", self.args.shutdown_grace)
        front = self.children["frontend"]  # already sent SIGTERM by _on_signal (a second one means "now")
        deadline = time.time() + self.args.shutdown_grace + 5
        while front.poll() is None and time.time() < deadline:
            for name in ("worker", "scheduler"):
                if self.children[name].poll() is not None:
                    log.error("%s died while draining", name)
                    return 1
            time.sleep(0.1)
        return 0

    def teardown(self) -> None:
        for name in ("frontend", "scheduler", "worker"):
            proc = self.children.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 5
        for proc in self.children.values():
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        unlink_segment(self.pool_name)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("stopped; nothing left behind")


def serve(args: ServerArgs) -> int:
    setup_logging("supervisor", args.log_level)
    if args.model is None:
        from ferroxmp.tiny_model import ensure_demo_model
        args.model = ensure_demo_model()
        log.warning("no --model given: serving the built-in DEMO model at %s — its weights are "
                    "RANDOM, so its text is gibberish; pass --model PATH for a real checkpoint",
                    args.model)
    return Supervisor(args).run()
