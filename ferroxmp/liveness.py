"""Liveness: how the supervisor tells a silent process from a living one.

Death is known for certain (the supervisor waits on its children); silence is only
a symptom. Each child stamps `time.monotonic()` (CLOCK_MONOTONIC: one clock for
every process on the machine) into its own slot of a small file in the run
directory, from the loop whose progress matters: the scheduler's event loop, the
worker's batch loop (stamped before and after each forward), the frontend's bridge
thread. The supervisor reads the slots; a child silent for `--stall-timeout` is
stalled, and is warned about at 50% and 80%.

A slow step is not a stall: a forward on a slow CPU (emulated bf16, a big chunk, a
busy machine) can outlast the timeout while the worker computes all along. So the
supervisor also reads each watched child's CPU time (/proc/PID/stat utime+stime):
a child that used at least MIN_CPU_SHARE of a core over a CPU_WINDOW_S window is
computing, and that counts as progress. A stuck child (SIGSTOPped, asleep on a
lock, blocked in a syscall) uses no CPU and is still called stalled on time. The
price: a child spinning in a livelock reads as computing (the scheduler's own step
bound, --max-step-seconds, keeps honest steps short).

Invariants: a stamp is one aligned 8-byte write (never torn); a child outside a
supervisor (no file) beats into nothing; each beating child dumps every thread's
Python stack to stderr (the server log) on SIGUSR1, so a stall can be diagnosed;
a child whose supervisor is gone removes the run directory on its way out (the
supervisor itself cannot when it was SIGKILLed).
"""
from __future__ import annotations

import faulthandler
import logging
import mmap
import os
import shutil
import signal
import struct
import time
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("ferroxmp.supervisor")
SLOTS = ("worker", "scheduler", "frontend")
FILE = "liveness"
WARN_AT = (0.5, 0.8)  # fractions of the stall timeout at which a silence is logged
CPU_WINDOW_S = 1.0  # CPU time is compared over windows this long (one tick is 10 ms)
MIN_CPU_SHARE = 0.1  # of one core: a loaded 2-core box still gives a computing worker more;
# a blocked process with a timer thread uses far less
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _path(run_dir: str) -> str:
    return os.path.join(run_dir, FILE)


class Heartbeat:
    """A child's side: `beat()` stamps now into its slot."""

    def __init__(self, run_dir: str, name: str) -> None:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        self.offset = 8 * SLOTS.index(name)
        self.mm: Optional[mmap.mmap] = None
        try:
            with open(_path(run_dir), "r+b") as f:
                self.mm = mmap.mmap(f.fileno(), 8 * len(SLOTS))
        except FileNotFoundError:
            pass  # not under a supervisor: nobody watches
        self.beat()

    def beat(self) -> None:
        if self.mm is not None:
            struct.pack_into("<d", self.mm, self.offset, time.monotonic())


@dataclass
class Monitor:
    """The supervisor's side: which watched child has been silent, and for how long."""
    run_dir: str
    timeout: float
    since: dict[str, float] = field(default_factory=dict)  # name -> when watching began
    warned: dict[str, float] = field(default_factory=dict)  # name -> highest fraction logged
    cpu: dict[str, "CpuMark"] = field(default_factory=dict)  # name -> its CPU clock, when a pid is known
    computing: dict[str, float] = field(default_factory=dict)  # name -> last window it used CPU in
    told: dict[str, float] = field(default_factory=dict)  # name -> the beat whose long step was logged
    seen: dict[str, float] = field(default_factory=dict)  # name -> the latest stamp read from its slot
    went_back: dict[str, float] = field(default_factory=dict)  # name -> the last read that went back (logged)
    mm: Optional[mmap.mmap] = None

    def __post_init__(self) -> None:
        with open(_path(self.run_dir), "w+b") as f:
            f.write(b"\0" * 8 * len(SLOTS))
            f.flush()
            self.mm = mmap.mmap(f.fileno(), 8 * len(SLOTS))

    def watch(self, name: str, pid: Optional[int] = None) -> None:
        """Start the clock of `name`; with `pid`, its CPU time also counts as progress."""
        now = time.monotonic()
        self.since[name] = now
        if pid is not None:
            self.cpu[name] = CpuMark(pid, cpu_seconds(pid) or 0.0, now)

    def forgive(self) -> None:
        """The supervisor itself was not running (paused, swapped out): what it missed
        is not the children's silence, so every clock restarts now."""
        now = time.monotonic()
        for name in self.since:
            self.since[name] = now
        for mark in self.cpu.values():
            mark.restart(now)

    def stamp(self, name: str) -> float:
        """The latest stamp of `name`'s slot ever read. A child's stamps only go forward
        (one clock, CLOCK_MONOTONIC), so a read that goes back is no news and is ignored,
        with a log line: three healthy servers on a VM were stopped after 5-9 minutes as
        "silent for 330-523 s" (since they started), their frontends beating all along,
        each time with no warning before, which only a read of a slot that went back to
        its first stamp explains (the cause, a clock or the mapping, was not found).
        Logged once per stamp that went back."""
        (stamp,) = struct.unpack_from("<d", self.mm, 8 * SLOTS.index(name))
        last = self.seen.get(name, 0.0)
        if stamp < last:
            if self.went_back.get(name) != stamp:
                self.went_back[name] = stamp
                log.warning("%s's liveness stamp went back %.3fs (read %r after %r); ignored", name, last - stamp,
                            stamp, last)
            return last
        self.seen[name] = stamp
        return stamp

    def silence(self, name: str, now: Optional[float] = None) -> float:
        """Seconds since the child last beat or was seen computing."""
        now = time.monotonic() if now is None else now
        return now - max(self.stamp(name), self.since[name], self.computing.get(name, 0.0))

    def _sample_cpu(self, name: str, now: float) -> None:
        mark = self.cpu.get(name)
        if mark is None or now - mark.at < CPU_WINDOW_S:
            return
        used = mark.advance(now)
        stamp = self.stamp(name)
        if used >= MIN_CPU_SHARE * CPU_WINDOW_S:
            if now - stamp >= self.timeout * WARN_AT[0] and self.told.get(name) != stamp:
                self.told[name] = stamp  # once per long step
                log.info("%s has not beaten for %.1fs but is computing (%.0f%% of a core): a slow step, "
                         "not a stall", name, now - stamp, 100 * used / CPU_WINDOW_S)
            self.computing[name] = now

    def stalled(self) -> Optional[tuple[str, float]]:
        """The first child silent past the timeout (name, seconds); logs approaching ones."""
        now = time.monotonic()
        for name in self.since:
            self._sample_cpu(name, now)
            quiet = self.silence(name, now)
            frac = quiet / self.timeout
            if frac >= 1.0:
                return name, quiet
            reached = max((w for w in WARN_AT if frac >= w), default=0.0)
            if reached > self.warned.get(name, 0.0):
                log.warning("%s has been silent for %.1fs (%.0f%% of --stall-timeout %.0fs); at 100%% "
                            "its stacks are dumped and the server stops", name, quiet, 100 * reached, self.timeout)
            elif reached == 0.0 and self.warned.get(name, 0.0) > 0.0:
                log.info("%s is responsive again", name)
            self.warned[name] = reached
        return None

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None


@dataclass
class CpuMark:
    """A child's CPU time (user + system, every thread) at the start of a window."""
    pid: int
    seconds: float
    at: float

    def advance(self, now: float) -> float:
        """CPU seconds used per wall second since the mark, times the window; moves it."""
        cpu = cpu_seconds(self.pid)
        if cpu is None:
            return 0.0
        used = (cpu - self.seconds) * CPU_WINDOW_S / max(now - self.at, 1e-9)
        self.seconds, self.at = cpu, now
        return used

    def restart(self, now: float) -> None:
        self.seconds, self.at = cpu_seconds(self.pid) or self.seconds, now


def cpu_seconds(pid: int) -> Optional[float]:
    """utime + stime of `pid` (all its threads) in seconds; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` (R, S, D, T = stopped, Z), '?' if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def remove_if_orphaned(run_dir: str, parent: int) -> None:
    """A child on its way out whose supervisor died removes the run directory: a
    SIGKILLed supervisor runs no cleanup of its own."""
    if os.getppid() != parent:
        shutil.rmtree(run_dir, ignore_errors=True)
