"""`ferroxmp serve`: create the run directory, start worker → scheduler → frontend,
wait for each to report ready, watch them, and tear everything down.

Invariants: nothing outlives the supervisor — on any exit path the children are
stopped, the shared-memory pool is unlinked and the run directory (sockets,
launch.json, liveness) is removed; when the supervisor is SIGKILLed its children
remove it, and a later start removes any a dead supervisor left. A child that dies
takes the server down with exit 1 (in-flight clients get an error first). A child
that is alive but silent for `--stall-timeout` has its Python stacks dumped to the
log and is then treated as dead; a shorter silence costs only latency.
SIGTERM/SIGINT drains and exits 0. No secret is written to disk: the API key
reaches the frontend through a pipe on its stdin.
"""
from __future__ import annotations

import glob
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
from ferroxmp.liveness import Monitor, process_state
from ferroxmp.protocol import ProtocolError, Ready, Shutdown, decode, encode, endpoints

log = logging.getLogger("ferroxmp.supervisor")
READY_TIMEOUT_S = 900.0  # model loading on a slow disk
WATCH_S = 0.2
SELF_PAUSE_S = 2.0  # a watch turn this late means the supervisor itself was not running
DUMP_WAIT_S = 1.0  # time for a stalled child to write its stacks after SIGUSR1
MODULES = {"worker": "ferroxmp.gpu_worker.worker", "scheduler": "ferroxmp.scheduler.scheduler",
           "frontend": "ferroxmp.frontend.server"}


class ChildDied(RuntimeError):
    pass


class ChildStalled(ChildDied):
    pass


def remove_stale_run_dirs() -> None:
    """Run directories whose supervisor is gone (SIGKILLed, and its children too)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "ferroxmp-*-*")):
        try:
            pid = int(os.path.basename(path).split("-")[1])
        except (IndexError, ValueError):
            continue
        if os.path.isdir(path) and os.stat(path).st_uid == os.getuid() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(path, ignore_errors=True)


def unlink_segment(name: str) -> None:
    try:
        from multiprocessing import _posixshmem  # type: ignore[attr-defined]
        _posixshmem.shm_unlink("/" + name)
    except (ImportError, FileNotFoundError, OSError):
        pass


class Supervisor:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        remove_stale_run_dirs()
        self.run_dir = tempfile.mkdtemp(prefix=f"ferroxmp-{os.getpid()}-")  # mode 0700
        self.monitor = Monitor(self.run_dir, args.stall_timeout)
        self.pool_name = f"fxmp_{os.getpid()}_{secrets.token_hex(4)}"
        self.ctx = zmq.Context()
        self.ep = endpoints(self.run_dir)
        self.ready_sock = self.ctx.socket(zmq.PULL)
        self.ready_sock.bind(self.ep["supervisor"])
        self.children: dict[str, subprocess.Popen] = {}
        # The key stays off the disk: the frontend reads it from a pipe (see start).
        self.launch: dict = {"args": {**args.to_dict(), "api_key": None}, "pool_name": self.pool_name,
                             "secrets_on_stdin": True}
        self.signalled: Optional[int] = None

    def _write_launch(self) -> None:
        tmp = os.path.join(self.run_dir, "launch.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.launch, f)
        os.replace(tmp, os.path.join(self.run_dir, "launch.json"))

    def start(self, name: str) -> Ready:
        self._write_launch()
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULES[name], "--run-dir", self.run_dir], stdin=subprocess.PIPE,
            start_new_session=True)  # a terminal's Ctrl-C reaches the supervisor only: it drains
        self.children[name] = proc
        given = {"api_key": self.args.api_key} if name == "frontend" else {}
        try:
            proc.stdin.write(json.dumps(given).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; _check_children says so
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
                    self.monitor.watch(name)
                    return msg
        raise ChildDied(f"{name} did not report ready within {READY_TIMEOUT_S:.0f}s")

    def _check_children(self) -> None:
        for name, proc in self.children.items():
            rc = proc.poll()
            if rc is not None:
                raise ChildDied(f"{name} (pid {proc.pid}) exited with {rc}")

    def _check_stall(self) -> None:
        """A child silent past --stall-timeout: dump its stacks, then stop as for a death."""
        found = self.monitor.stalled()
        if found is None:
            return
        name, quiet = found
        proc = self.children[name]
        state = process_state(proc.pid)
        log.error("%s (pid %d, state %s) has been silent for %.1fs (--stall-timeout %.0fs); its Python "
                  "stacks follow%s", name, proc.pid, state, quiet, self.args.stall_timeout,
                  " (it is STOPPED, so it cannot write them)" if state == "T" else "")
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(DUMP_WAIT_S)
        except ProcessLookupError:
            pass
        raise ChildStalled(f"{name} (pid {proc.pid}) stalled: silent for {quiet:.0f}s")

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
            last = time.monotonic()
            while self.signalled is None:
                self._check_children()
                now = time.monotonic()
                if now - last > SELF_PAUSE_S:
                    log.warning("the supervisor itself did not run for %.1fs; stall clocks restart", now - last)
                    self.monitor.forgive()
                last = now
                self._check_stall()
                time.sleep(WATCH_S)
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
        sock.send(encode(Shutdown(f"a server process failed: {why}")))
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
        self.monitor.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("stopped; nothing left behind")


def serve(args: ServerArgs) -> int:
    setup_logging("supervisor", args.log_level)
    from ferroxmp.checkpoint.default_model import resolve_model
    try:
        resolve_model(args)  # None -> the default model, 'demo' -> random weights; a GGUF is checked
    except (OSError, ValueError) as e:
        log.error("cannot serve this model: %s", e)
        return 2
    return Supervisor(args).run()
