"""Real worker + scheduler processes, and a test client that speaks protocol.py.

`SchedulerClient` plays the frontend: it binds the frontend's PULL socket and
PUSHes `GenerateReq` / `AbortReq` to the scheduler. Processes are started through
the supervisor's own `start`, and `close` always tears them down and unlinks the
pool.
"""
from __future__ import annotations

import time
from typing import Optional

import zmq

from ferroxmp.config import ServerArgs
from ferroxmp.protocol import (AbortReq, GenerateReq, RowOut, SamplingParams, Stats, TokenOut, decode,
                               encode, pack_ids, unpack_ids)
from ferroxmp.page_pool import PagePool
from ferroxmp.supervisor import Supervisor


class SchedulerClient:
    def __init__(self, model: str, **flags) -> None:
        flags.setdefault("page_size", 4)
        flags.setdefault("kv_pages", 512)
        flags.setdefault("max_running_requests", 64)
        self.sup = Supervisor(ServerArgs(model=model, **flags))
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.sup.ep["frontend"])
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        try:
            self.worker_info = self.sup.start("worker").info
            self.sup.launch["worker_info"] = self.worker_info
            self.sup.start("scheduler")
        except BaseException:
            self.close()
            raise
        self.push.connect(self.sup.ep["scheduler"])
        self.outputs: dict[str, list[int]] = {}
        self.finals: dict[str, RowOut] = {}
        self.messages: list[TokenOut] = []
        self.stats: Optional[Stats] = None
        self._n = 0

    def submit(self, prompt: list[int], max_tokens: int = 8, rid: Optional[str] = None, **params) -> str:
        rid = rid or f"r{self._n}"
        self._n += 1
        params.setdefault("temperature", 0.0)
        self.outputs[rid] = []
        self.push.send(encode(GenerateReq(rid, pack_ids(prompt), SamplingParams(max_tokens=max_tokens, **params),
                                          time.time())))
        return rid

    def abort(self, rid: str) -> None:
        self.push.send(encode(AbortReq(rid)))

    def pump(self, timeout: float = 0.1) -> None:
        if not self.pull.poll(int(timeout * 1000)):
            return
        while True:
            try:
                msg = decode(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            assert isinstance(msg, TokenOut)
            self.messages.append(msg)
            if msg.stats is not None:
                self.stats = msg.stats
            for out in msg.outs:
                self.outputs.setdefault(out.rid, []).extend(unpack_ids(out.token_ids).tolist())
                if out.finish_reason:
                    self.finals[out.rid] = out

    def wait(self, rids, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while not all(r in self.finals for r in rids):
            self.sup._check_children()
            assert time.time() < deadline, f"unfinished after {timeout}s: {[r for r in rids if r not in self.finals]}"
            self.pump()

    def pump_until(self, done, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while not done():
            self.sup._check_children()
            assert time.time() < deadline, f"condition not met within {timeout}s; finals: {self.finals}"
            self.pump()

    def generate(self, prompt: list[int], max_tokens: int = 8, **params) -> list[int]:
        rid = self.submit(prompt, max_tokens, **params)
        self.wait([rid])
        return self.outputs[rid]

    def wait_idle_stats(self, timeout: float = 10.0) -> Stats:
        """The first heartbeat that shows nothing running or waiting."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.stats = None
            self.pump(0.6)
            s = self.stats
            if s is not None and s.running == 0 and s.waiting == 0:
                return s
        raise AssertionError(f"never idle: {self.stats}")

    def pool(self) -> PagePool:
        return PagePool.attach(self.sup.pool_name)

    def close(self) -> None:
        if self.ctx.closed:
            return
        self.sup.teardown()
        self.ctx.destroy(linger=0)
