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


def test_a_sleeper_wakes_at_a_signal_and_at_a_childs_exit_and_waits_out_a_dead_child():
    """Sleeper (the serving supervisor's wait): a 30 s wait ends at a signal (its handler
    has run) and at a watched child's exit, well before its timeout; once the child is
    reaped its pidfd, readable for good, is no longer waited on, so a wait lasts its
    timeout instead of returning at once (the loop would spin)."""
    import subprocess
    import sys
    import time

    from ferroxmp.wakeup import Sleeper
    seen = []
    old = signal.signal(signal.SIGUSR2, lambda *_: seen.append("handled"))
    sleeper = Sleeper(fallback=0.05)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        assert sleeper.pipe is not None and sleeper._pidfd(child.pid) is not None, "no pidfd on this kernel"
        timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGUSR2))
        timer.start()
        t0 = time.monotonic()
        sleeper.wait(30, [child])
        assert seen == ["handled"] and time.monotonic() - t0 < 10
        sleeper.wait(30, [child])  # the child exits at ~0.5 s
        assert time.monotonic() - t0 < 10 and child.poll() == 0
        t1 = time.monotonic()
        sleeper.wait(0.3, [child])
        assert time.monotonic() - t1 >= 0.25, "waited on an exited child's pidfd"
    finally:
        child.kill()
        child.wait()
        sleeper.close()
        signal.signal(signal.SIGUSR2, old)
