"""The worker as a process: handshake, batches over ZeroMQ, malformed frames, and every
way out (Shutdown, SIGTERM, parent death) leaving no shared memory behind.

The test plays supervisor and scheduler: it binds the "supervisor" and "worker_results"
PULL sockets, writes launch.json, attaches to the pool the worker created and writes
the page table. Token oracle: transformers' greedy generate on the same prompt.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import shared_memory

import pytest
import torch
import zmq

from ferroxmp import protocol
from ferroxmp.config import ServerArgs
from ferroxmp.protocol import ForwardBatch, RowStep, SamplingParams, Shutdown, pack_ids, unpack_ids
from ferroxmp.page_pool import PagePool

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = [sys.executable, "-m", "ferroxmp.gpu_worker.worker", "--run-dir"]


def shm_exists(name: str) -> bool:
    # Look, do not attach: on Python < 3.13 attaching registers the segment with this
    # process's resource tracker, which would unlink it at exit.
    return os.path.exists(os.path.join("/dev/shm", name))


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()
    except FileNotFoundError:
        return True


class Session:
    def __init__(self, model: str, launcher: bool = False, env: dict | None = None):
        self.run_dir = tempfile.mkdtemp(prefix="fxw-")
        os.chmod(self.run_dir, 0o700)
        self.pool_name = f"fxt_{os.getpid()}_{secrets.token_hex(4)}"
        args = ServerArgs(model=model, device="cpu", kv_pages=64, max_running_requests=4, max_model_len=500,
                          page_size=16, log_level="warning")
        with open(os.path.join(self.run_dir, "launch.json"), "w") as f:
            json.dump({"args": args.to_dict(), "pool_name": self.pool_name}, f)
        ends = protocol.endpoints(self.run_dir)
        self.ctx = zmq.Context()
        self.ready = self.ctx.socket(zmq.PULL)
        self.ready.bind(ends["supervisor"])
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(ends["worker_results"])
        self.batches = self.ctx.socket(zmq.PUSH)
        self.batches.setsockopt(zmq.LINGER, 0)
        self.batches.connect(ends["worker"])
        env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
        if launcher:  # a parent we can kill: it starts the worker, prints its pid, sleeps
            code = ("import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:]); "
                    "print(p.pid, flush=True); time.sleep(600)")
            self.proc = subprocess.Popen([sys.executable, "-c", code] + WORKER + [self.run_dir],
                                         stdout=subprocess.PIPE, env=env, text=True)
            self.pid = int(self.proc.stdout.readline())
        else:
            self.proc = subprocess.Popen(WORKER + [self.run_dir], env=env)
            self.pid = self.proc.pid
        self.pool = None

    def recv(self, sock, timeout_s: float):
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"nothing on {sock} within {timeout_s}s")
        return protocol.decode(sock.recv())

    def wait_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and gone(self.pid):
                return True
            if gone(self.pid):
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for pid in {self.pid, self.proc.pid}:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()
        if shm_exists(self.pool_name):
            shared_memory.SharedMemory(name=self.pool_name).unlink()
        self.ctx.destroy(linger=0)
        if os.path.isdir(self.run_dir):  # an orphaned worker removes it itself
            for name in os.listdir(self.run_dir):
                os.unlink(os.path.join(self.run_dir, name))
            os.rmdir(self.run_dir)


@pytest.fixture
def session(tiny_models):
    made = []

    def start(shape="llama", launcher=False, env=None):
        s = Session(tiny_models[shape], launcher, env)
        made.append(s)
        return s
    yield start
    for s in made:
        s.close()


def test_the_worker_handshakes_computes_and_shuts_down_cleanly(session, tiny_models):
    """Ready carries the pool geometry the scheduler needs; greedy tokens over the wire equal
    transformers'; a garbage frame is dropped without harm; Shutdown exits 0 and the
    shared memory is gone."""
    s = session("qwen2")
    ready = s.recv(s.ready, 120)
    assert isinstance(ready, protocol.Ready) and ready.name == "worker" and ready.pid == s.pid
    info = ready.info
    assert info["num_pages"] == 64 and info["page_size"] == 16 and info["max_rows"] == 4
    assert info["max_model_len"] == 500 and info["max_pages_per_row"] == math.ceil(500 / 16)
    assert info["eos_token_ids"] == [2, 0] and info["sliding_window"] is None
    assert (info["model_type"], info["dtype"], info["device"]) == ("qwen2", "float32", "cpu")
    s.pool = PagePool.attach(s.pool_name, writer=True)
    s.pool.set_row(1, list(range(10)), 0)
    prompt = list(range(40, 60))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"])
    hf.generation_config.eos_token_id = None
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)[0, 20:].tolist()
    new = protocol.NewRow(1, pack_ids(prompt), SamplingParams(temperature=0.0), 0)
    s.batches.send(protocol.encode(ForwardBatch(1, [new], [RowStep(1, 0, 20, True)])))
    got = []
    for i in range(5):
        res = s.recv(s.results, 30)
        assert isinstance(res, protocol.BatchResult) and res.batch_id == i + 1 and res.error is None
        assert unpack_ids(res.rows).tolist() == [1]
        got.append(int(unpack_ids(res.tokens)[0]))
        s.batches.send(b"\x93garbage")
        s.batches.send(protocol.encode(ForwardBatch(i + 2, [], [RowStep(1, 20 + i, 1, True)])))
    assert got == ref
    s.recv(s.results, 30)
    s.batches.send(protocol.encode(ForwardBatch(99, [], [RowStep(3, 0, 1, True)])))
    assert s.recv(s.results, 30).error
    s.batches.send(protocol.encode(Shutdown(reason="test")))
    assert s.proc.wait(timeout=15) == 0
    assert not shm_exists(s.pool_name)


def test_sigterm_stops_the_worker_and_frees_the_pool(session):
    s = session()
    s.recv(s.ready, 120)
    assert shm_exists(s.pool_name)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=15) == 0
    assert not shm_exists(s.pool_name)


def test_a_sigterm_during_a_step_lets_the_step_answer_then_stops(session):
    """Once serving, SIGTERM is a request the loop answers at its next turn, never an
    exception raised wherever the worker happens to be (one raised inside a finalizer that
    gc runs is swallowed, and a worker went on serving after it). The step under way (made
    to compute for 2 s) still answers its row, then the worker exits 0 and frees the pool."""
    busy = 9
    s = session(env={"FERROXMP_FAULT_INJECT": f"forward_busy_token={busy}:2"})
    s.recv(s.ready, 120)
    s.pool = PagePool.attach(s.pool_name, writer=True)
    s.pool.set_row(1, [0, 1], 0)
    new = protocol.NewRow(1, pack_ids([busy] * 8), SamplingParams(temperature=0.0), 0)
    s.batches.send(protocol.encode(ForwardBatch(1, [new], [RowStep(1, 0, 8, True)])))
    time.sleep(0.7)  # the step is computing
    s.proc.send_signal(signal.SIGTERM)
    res = s.recv(s.results, 30)
    assert isinstance(res, protocol.BatchResult) and res.batch_id == 1 and res.error is None
    assert unpack_ids(res.rows).tolist() == [1]
    assert s.proc.wait(timeout=15) == 0
    assert not shm_exists(s.pool_name)


def test_the_worker_exits_soon_after_its_parent_dies(session):
    """SIGKILL the parent: no chance to clean up for it, so the worker itself must notice
    (PDEATHSIG or the getppid poll), exit within a few seconds and unlink the pool."""
    s = session(launcher=True)
    s.recv(s.ready, 120)
    s.proc.kill()
    s.proc.wait(timeout=10)
    assert s.wait_gone(5.0), "worker outlived its parent"
    deadline = time.monotonic() + 5
    while (shm_exists(s.pool_name) or os.path.isdir(s.run_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shm_exists(s.pool_name)
    assert not os.path.isdir(s.run_dir), "an orphaned worker must remove the run directory"


def test_an_unsupported_model_fails_fast_with_its_name_and_leaves_nothing(tiny_models, tmp_path):
    """The supervisor only sees the child die: stderr must name the architecture, the exit
    code must be non-zero, and no shared memory may be left."""
    import shutil
    model = str(tmp_path / "gpt2")
    shutil.copytree(tiny_models["llama"], model)
    cfg = json.load(open(os.path.join(model, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(model, "config.json"), "w"))
    name = f"fxt_{os.getpid()}_{secrets.token_hex(4)}"
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    args = ServerArgs(model=model, device="cpu", kv_pages=8).to_dict()
    (run_dir / "launch.json").write_text(json.dumps({"args": args, "pool_name": name}))
    proc = subprocess.run(WORKER + [str(run_dir)], env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "GPT2LMHeadModel" in proc.stderr and "Traceback" not in proc.stderr
    assert not shm_exists(name)
