"""The stall clock itself, without processes: a beat resets it, silence is warned
about at 50% and 80% exactly once each, 100% is a stall, and a supervisor that was
itself paused forgives what it missed (else its own SIGSTOP would kill the server)."""
from __future__ import annotations

import logging
import os
import signal
import time

from ferroxmp.liveness import Heartbeat, Monitor, process_state, remove_if_orphaned

TIMEOUT = 0.5


def test_silence_is_warned_at_half_and_four_fifths_then_called_a_stall(tmp_path, caplog):
    mon = Monitor(str(tmp_path), TIMEOUT)
    heart = Heartbeat(str(tmp_path), "scheduler")
    mon.watch("scheduler")
    caplog.set_level(logging.INFO, "ferroxmp.supervisor")
    seen = []
    deadline = time.monotonic() + 5
    while (found := mon.stalled()) is None:
        assert time.monotonic() < deadline, "a silent child was never called stalled"
        seen.append(mon.silence("scheduler"))
        time.sleep(0.01)
    name, quiet = found
    assert name == "scheduler" and quiet >= TIMEOUT
    warnings = [r.getMessage() for r in caplog.records if "silent for" in r.getMessage()]
    assert len(warnings) == 2 and "(50% of" in warnings[0] and "(80% of" in warnings[1], warnings
    heart.beat()
    assert mon.silence("scheduler") < 0.1 and mon.stalled() is None
    assert any("responsive again" in r.getMessage() for r in caplog.records)
    mon.close()


def test_a_beating_child_is_never_stalled_and_forgive_restarts_every_clock(tmp_path):
    mon = Monitor(str(tmp_path), TIMEOUT)
    heart = Heartbeat(str(tmp_path), "worker")
    mon.watch("worker")
    mon.watch("frontend")  # never beats
    for _ in range(20):
        heart.beat()
        assert mon.silence("worker") < TIMEOUT / 2
        time.sleep(0.02)
    assert mon.silence("frontend") >= 0.3
    mon.forgive()
    assert mon.silence("frontend") < 0.1, "forgive must restart the clock of a silent child"
    mon.close()


def test_a_heartbeat_outside_a_supervisor_beats_into_nothing(tmp_path):
    Heartbeat(str(tmp_path), "frontend").beat()  # no liveness file: no error


def test_process_state_tells_a_stopped_process(tmp_path):
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    try:
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(pid) == "T"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert process_state(pid) == "?"


def test_only_an_orphan_removes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    remove_if_orphaned(str(run_dir), os.getppid())  # our parent is alive: keep it
    assert run_dir.exists()
    remove_if_orphaned(str(run_dir), -1)  # a parent we no longer have: remove it
    assert not run_dir.exists()


def _burner() -> int:
    """A child that computes forever and never beats (a forward longer than the timeout)."""
    pid = os.fork()
    if pid == 0:
        while True:
            sum(range(2000))
    return pid


def test_a_computing_child_is_not_stalled_but_the_same_child_stopped_is(tmp_path, monkeypatch, caplog):
    """The worker's heartbeat is stamped between steps, so a step longer than
    --stall-timeout used to read as a stall and kill the server. A child whose CPU time
    advances must never be called stalled, however long it stays silent; the same child
    SIGSTOPped (no CPU) must be, within about the timeout. Both halves run on one child,
    so the only difference between them is whether it computes."""
    import ferroxmp.liveness as liveness
    monkeypatch.setattr(liveness, "CPU_WINDOW_S", 0.2)
    caplog.set_level(logging.INFO, "ferroxmp.supervisor")
    timeout = 1.0
    pid = _burner()
    mon = Monitor(str(tmp_path), timeout)
    try:
        mon.watch("worker", pid)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * timeout:
            assert mon.stalled() is None, f"a computing child was called stalled after {time.monotonic() - t0:.1f}s"
            time.sleep(0.05)
        assert any("is computing" in r.getMessage() for r in caplog.records), "the long step was not logged"
        assert not any("silent for" in r.getMessage() for r in caplog.records)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while (found := mon.stalled()) is None:
            assert time.monotonic() - t0 < timeout + 2.0, "a stopped child was never called stalled"
            time.sleep(0.05)
        assert found[0] == "worker" and found[1] >= timeout
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        mon.close()


def test_a_stamp_read_that_goes_back_is_ignored_not_called_a_stall(tmp_path, caplog):
    """A child's stamps only go forward; a read of its slot that goes back (to its first
    stamp, or to zero) must not make a beating child look silent since its start: three
    healthy servers were stopped so. Logged once, and a real silence is still a stall."""
    import struct
    mon = Monitor(str(tmp_path), TIMEOUT)
    heart = Heartbeat(str(tmp_path), "frontend")  # its first stamp, as at the frontend's start
    (first,) = struct.unpack_from("<d", heart.mm, heart.offset)
    mon.watch("frontend")
    caplog.set_level(logging.WARNING, "ferroxmp.supervisor")
    for back in (first, 0.0):
        time.sleep(TIMEOUT * 1.2)
        heart.beat()
        assert mon.silence("frontend") < TIMEOUT / 2
        struct.pack_into("<d", heart.mm, heart.offset, back)  # the slot read back at its start
        for _ in range(3):
            assert mon.stalled() is None and mon.silence("frontend") < TIMEOUT / 2
    assert sum("went back" in r.getMessage() for r in caplog.records) == 2
    deadline = time.monotonic() + 5
    while mon.stalled() is None:  # no beat since: a silence all the same
        assert time.monotonic() < deadline, "a silent child was never called stalled"
        time.sleep(0.01)
    mon.close()
