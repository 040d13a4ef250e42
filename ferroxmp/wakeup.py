"""A signal that wakes a zmq poll: the loops of the scheduler and the worker wait in
`Poller.poll(timeout)`, and a Python signal handler runs only once that C call returns,
so without this a SIGTERM to an idle process took effect only when its poll timed out
(the worker's 500 ms, the scheduler's heartbeat): every server stop paid it.

`wake_on_signals(poller)` registers a pipe that the interpreter writes a byte to on any
signal (`signal.set_wakeup_fd`); the poll returns, the handler runs. The caller empties
the pipe with `drain(fd)` when the poll reports it. Main thread only (set_wakeup_fd).

`Sleeper` is the same for a loop with no sockets (the supervisor's, the frontend's main
loop): a wait that a signal or a watched child's exit ends at once.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
from typing import Optional

import zmq


def _signal_pipe() -> tuple[int, int]:
    """A pipe (read end, write end) that every signal writes a byte to."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    return r, w


def wake_on_signals(poller: zmq.Poller) -> int:
    """Register the wake-up pipe with `poller`; returns its read end."""
    r, _ = _signal_pipe()
    poller.register(r, zmq.POLLIN)
    return r


class Sleeper:
    """`wait(timeout, procs)` returns at a signal, at the exit of one of `procs`, or after
    `timeout`. Why: time.sleep resumes after a signal's handler (PEP 475), so seeing a
    signal or a death within 50 ms took 20 Python wake-ups a second; the idle supervisor
    spent 6 ms of CPU a second on them (this 2-core box), taken from the worker's compute
    threads. A child's exit is seen through its pidfd (Linux 5.3+); where there is none,
    or off the main thread (no wake-up pipe), waits are at most `fallback` long."""

    def __init__(self, fallback: float) -> None:
        self.fallback = fallback
        self.pidfds: dict[int, Optional[int]] = {}  # pid -> its pidfd (None: not to be had)
        try:
            self.pipe: Optional[tuple[int, int]] = _signal_pipe()
        except ValueError:  # not the main thread
            self.pipe = None

    def _pidfd(self, pid: int) -> Optional[int]:
        if pid not in self.pidfds:
            try:
                self.pidfds[pid] = os.pidfd_open(pid)
            except (AttributeError, OSError):
                self.pidfds[pid] = None
        return self.pidfds[pid]

    def wait(self, timeout: float, procs: list[subprocess.Popen]) -> None:
        # an exited child's pidfd stays readable: only the living are waited on
        fds = [self._pidfd(p.pid) for p in procs if p.returncode is None]
        if self.pipe is None or None in fds:
            timeout = min(timeout, self.fallback)
        watched = [f for f in fds if f is not None] + ([self.pipe[0]] if self.pipe is not None else [])
        select.select(watched, [], [], timeout)
        if self.pipe is not None:
            drain(self.pipe[0])

    def close(self) -> None:
        if self.pipe is not None:
            signal.set_wakeup_fd(-1)
            for fd in self.pipe:
                os.close(fd)
            self.pipe = None
        for fd in self.pidfds.values():
            if fd is not None:
                os.close(fd)
        self.pidfds.clear()


def drain(fd: int) -> None:
    """Empty the pipe (the handlers already ran: the bytes only say a signal came)."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
