"""wakeup.py: a signal ends a zmq poll that would otherwise wait for its timeout.

Oracle: what the poll returns. Without the pipe, a 20 s poll with nothing to read
returns nothing once its 20 s are up (the signal's handler runs only then); with it,
the poll reports the pipe and the handler has run, and the pipe is emptied for the next
poll (which then times out empty).
"""
from __future__ import annotations

import os
import signal
import threading

import zmq

from ferroxmp.wakeup import drain, wake_on_signals


def test_a_signal_ends_the_poll_and_its_handler_runs_before_the_loop_goes_on():
    seen = []
    old = signal.signal(signal.SIGUSR2, lambda *_: seen.append("handled"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("inproc://wakeup-test")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    wake = wake_on_signals(poller)
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGUSR2))
    try:
        timer.start()
        ready = dict(poller.poll(20_000))
        assert wake in ready and sock not in ready
        assert seen == ["handled"]
        drain(wake)
        assert dict(poller.poll(0)) == {}, "the pipe was not emptied"
    finally:
        timer.cancel()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGUSR2, old)
        os.close(wake)
        sock.close(linger=0)
        ctx.term()
