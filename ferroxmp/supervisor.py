"""`ferroxmp serve`: create the run directory, start worker → scheduler → frontend,
wait for each to report ready, watch them, and tear everything down.

Invariants: nothing outlives the supervisor — on any exit path the children are
stopped, the shared-memory pool is unlinked and the run directory (sockets,
launch.json, liveness) is removed; when the supervisor is SIGKILLed its children
remove it, and a later start removes any a dead supervisor left; when every process
was SIGKILLed, a later start also unlinks the pool (shm_names.py). A child that dies
takes the server down with exit 1 (in-flight clients get an error first). A child
that is alive but silent for `--stall-timeout` and not computing (its CPU time does
not advance: liveness.py) has its Python stacks dumped to the log and is then
treated as dead; a shorter silence, or a long step that computes, costs only latency.
SIGTERM/SIGINT drains and exits 0. No secret is written to disk: the API key
reaches the frontend through a pipe on its stdin.

Tensor parallelism (--tp N over --nnodes M): each node's supervisor starts its N/M
worker ranks at once (rank 0 is the worker the scheduler talks to; the others run
gpu_worker/parallel/rank.py) and waits for all of them; they rendezvous in the run directory
(one node) or at --dist-init-addr. Node 0 then starts the scheduler and the frontend.
A node with --node-rank > 0 runs only its ranks: it exits 0 when rank 0 stops them, and
1 (taking node 0 down through the lost connection) when any of its ranks dies.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

import zmq

from ferroxmp.config import ServerArgs, setup_logging
from ferroxmp.forked import in_child
from ferroxmp.liveness import Monitor, process_state
from ferroxmp.protocol import ProtocolError, Ready, Shutdown, decode, encode, endpoints
from ferroxmp.shm_names import remove_dead_segments, segment_name
from ferroxmp.wakeup import Sleeper

log = logging.getLogger("ferroxmp.supervisor")
READY_TIMEOUT_S = 900.0  # model loading on a slow disk
WATCH_S = 0.05  # how soon a signal or a dead child is seen while starting or stopping (and
# while serving where a Sleeper has no pidfd for a child)
SERVE_TURN_S = 0.25  # while serving, how often stalls are checked (a signal or a death ends the wait)
SELF_PAUSE_S = 2.0  # a watch turn this late means the supervisor itself was not running
DUMP_WAIT_S = 1.0  # time for a stalled child to write its stacks after SIGUSR1
MODULES = {"worker": "ferroxmp.gpu_worker.worker", "scheduler": "ferroxmp.scheduler.scheduler",
           "frontend": "ferroxmp.frontend.server", "rank": "ferroxmp.gpu_worker.parallel.rank"}
WATCHED = ("worker", "scheduler", "frontend")  # children with a heartbeat slot (liveness.py);
# ranks > 0 have none: one that stops makes rank 0 wait inside a collective, and rank 0 is watched
RANK0_STOP_S = 3.0  # at teardown: time for rank 0 to tell the other ranks to stop


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


class Supervisor:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        remove_stale_run_dirs()
        self.run_dir = tempfile.mkdtemp(prefix=f"ferroxmp-{os.getpid()}-")  # mode 0700
        self.monitor = Monitor(self.run_dir, args.stall_timeout)
        self.pool_name = segment_name()  # fxmp_<pid>_<start time>_<random>: a later serve can tell ours dead
        self.ctx = zmq.Context()
        self.ep = endpoints(self.run_dir)
        self.ready_sock = self.ctx.socket(zmq.PULL)
        self.ready_sock.bind(self.ep["supervisor"])
        self.children: dict[str, subprocess.Popen] = {}
        # The key stays off the disk: the frontend reads it from a pipe (see start).
        self.launch: dict = {"args": {**args.to_dict(), "api_key": None, "admin_api_key": None}, "pool_name": self.pool_name,
                             "secrets_on_stdin": True}
        if args.tp > 1:
            init = (f"tcp://{args.dist_init_addr}" if args.nnodes > 1
                    else f"file://{os.path.join(self.run_dir, 'tp_rendezvous')}")
            self.launch["tp"] = {"init_method": init, "world": args.tp, "nnodes": args.nnodes}
        self.signalled: Optional[int] = None
        self.sleeper: Optional[Sleeper] = None  # run()'s: it takes the signal wake-up (main thread)

    def _write_launch(self) -> None:
        tmp = os.path.join(self.run_dir, "launch.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.launch, f)
        os.replace(tmp, os.path.join(self.run_dir, "launch.json"))

    def start(self, name: str) -> Ready:
        self._spawn(name)
        return self._await_ready([name])[name]

    def start_workers(self) -> Ready:
        """This node's worker ranks, all at once (they rendezvous with each other), each
        ready when every rank of the group has loaded its shard. Returns rank 0's Ready."""
        per_node = self.args.tp // self.args.nnodes
        first = self.args.node_rank * per_node
        names = [self._spawn("worker" if r == 0 else f"worker{r}", rank=r) for r in range(first, first + per_node)]
        return self._await_ready(names).get("worker")

    def _spawn(self, name: str, rank: int = 0) -> str:
        self._write_launch()
        module = MODULES["rank"] if rank > 0 else MODULES[name]
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--run-dir", self.run_dir] + (["--rank", str(rank)] if rank else []),
            stdin=subprocess.PIPE, start_new_session=True)  # a terminal's Ctrl-C reaches the supervisor only
        self.children[name] = proc
        given = ({"api_key": self.args.api_key, "admin_api_key": self.args.admin_api_key}
                 if name == "frontend" else {})
        try:
            proc.stdin.write(json.dumps(given).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; _check_children says so
        return name

    def _await_ready(self, names: list[str]) -> dict[str, Ready]:
        got: dict[str, Ready] = {}
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
                if isinstance(msg, Ready) and msg.name in names:
                    got[msg.name] = msg
                    if msg.name in WATCHED:
                        self.monitor.watch(msg.name, msg.pid)  # its CPU time counts as progress
                    if len(got) == len(names):
                        return got
        raise ChildDied(f"{sorted(set(names) - set(got))} did not report ready within {READY_TIMEOUT_S:.0f}s")

    def _check_children(self, exit_0_ok: bool = False) -> None:
        for name, proc in self.children.items():
            rc = proc.poll()
            if rc is not None and not (exit_0_ok and rc == 0):
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
        self.sleeper = Sleeper(WATCH_S)
        try:
            if self.args.node_rank > 0:
                return self._serve_ranks_only()
            worker = self.start_workers()
            self.launch["worker_info"] = worker.info
            log.info("worker ready: %s", worker.info)
            self.start("scheduler")
            self.launch["pids"] = {"supervisor": os.getpid(), "scheduler": self.children["scheduler"].pid,
                                   "workers": [p.pid for n, p in self.children.items() if n.startswith("worker")]}
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
                self.sleeper.wait(SERVE_TURN_S, list(self.children.values()))
            return self._drain()
        except ChildDied as e:
            log.error("%s; stopping the server", e)
            self._fail_inflight(str(e))
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            self.teardown()

    def _serve_ranks_only(self) -> int:
        """--node-rank > 0: this node's ranks only. 0 when they all exited 0 (rank 0 told
        them to stop) or on SIGTERM; a rank that fails raises ChildDied (exit 1)."""
        self.start_workers()
        log.info("node %d of %d: worker ranks %s ready; node 0 serves", self.args.node_rank, self.args.nnodes,
                 sorted(n for n in self.children))
        while self.signalled is None:
            codes = [p.poll() for p in self.children.values()]
            if all(c == 0 for c in codes):
                log.info("rank 0 stopped this node's ranks")
                return 0
            self._check_children(exit_0_ok=True)
            self.sleeper.wait(SERVE_TURN_S, list(self.children.values()))
        return 0

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
            for name in self.children:
                if name != "frontend" and self.children[name].poll() is not None:
                    log.error("%s died while draining", name)
                    return 1
            time.sleep(0.1)
        return 0

    def teardown(self) -> None:
        for name in ("frontend", "scheduler", "worker"):
            proc = self.children.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        rank0 = self.children.get("worker")
        others = [p for n, p in self.children.items() if n.startswith("worker") and n != "worker"]
        if rank0 is not None and others:
            try:  # rank 0 stops the other ranks (on every node) on its way out
                rank0.wait(RANK0_STOP_S)
            except subprocess.TimeoutExpired:
                pass
        for proc in others:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 5
        for name, proc in self.children.items():
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.returncode not in (0, -signal.SIGTERM):
                log.info("%s (pid %d) ended with %s", name, proc.pid, proc.returncode)
        from ferroxmp.page_pool import remove_segment  # numpy: imported at the end, not for the server's life
        remove_segment(self.pool_name)  # a worker killed with -9 could not (page_pool.py)
        self.monitor.close()
        if self.sleeper is not None:
            self.sleeper.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("stopped; nothing left behind")


def _checked_model(args: ServerArgs) -> list:
    """[model path, served name] once the checkpoint is found and checked whole."""
    from ferroxmp.checkpoint.default_model import resolve_model
    from ferroxmp.checkpoint.validate import validate_checkpoint
    resolve_model(args)  # None -> the default model, 'demo' -> random weights; a GGUF is checked
    validate_checkpoint(args.model)  # the whole file, before any child starts (a CheckpointError: exit 2)
    return [args.model, args.served_model_name]


def serve(args: ServerArgs) -> int:
    setup_logging("supervisor", args.log_level)
    try:
        args.model, args.served_model_name = in_child(_checked_model, args)
    except (OSError, ValueError) as e:
        log.error("cannot serve this model: %s", e)
        return 2
    try:
        in_child(remove_dead_segments)  # pools of servers killed with -9 (shm_names.py); one log line each
    except ValueError as e:
        log.warning("could not look for segments of dead servers: %s", e)
    return Supervisor(args).run()
