"""A signal that wakes a zmq poll: the loops of the scheduler and the worker wait in
`Poller.poll(timeout)`, and a Python signal handler runs only once that C call returns,
so without this a SIGTERM to an idle process took effect only when its poll timed out
(the worker's 500 ms, the scheduler's heartbeat): every server stop paid it.

`wake_on_signals(poller)` registers a pipe that the interpreter writes a byte to on any
signal (`signal.set_wakeup_fd`); the poll returns, the handler runs. The caller empties
the pipe with `drain(fd)` when the poll reports it. Main thread only (set_wakeup_fd).
"""
from __future__ import annotations

import os
import signal

import zmq


def wake_on_signals(poller: zmq.Poller) -> int:
    """Register the wake-up pipe with `poller`; returns its read end."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    poller.register(r, zmq.POLLIN)
    return r


def drain(fd: int) -> None:
    """Empty the pipe (the handlers already ran: the bytes only say a signal came)."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
