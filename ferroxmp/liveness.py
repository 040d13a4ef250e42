"""Liveness: how the supervisor tells a silent process from a living one.

Death is known for certain (the supervisor waits on its children); silence is only
a symptom. Each child stamps `time.monotonic()` (CLOCK_MONOTONIC: one clock for
every process on the machine) into its own slot of a small file in the run
directory, from the loop whose progress matters: the scheduler's event loop, the
worker's batch loop (a forward counts as one turn: it must end within the stall
timeout), the frontend's bridge thread. The supervisor reads the slots; a child
silent for `--stall-timeout` is stalled, and is warned about at 50% and 80%.

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
    mm: Optional[mmap.mmap] = None

    def __post_init__(self) -> None:
        with open(_path(self.run_dir), "w+b") as f:
            f.write(b"\0" * 8 * len(SLOTS))
            f.flush()
            self.mm = mmap.mmap(f.fileno(), 8 * len(SLOTS))

    def watch(self, name: str) -> None:
        self.since[name] = time.monotonic()

    def forgive(self) -> None:
        """The supervisor itself was not running (paused, swapped out): what it missed
        is not the children's silence, so every clock restarts now."""
        now = time.monotonic()
        for name in self.since:
            self.since[name] = now

    def silence(self, name: str, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        (stamp,) = struct.unpack_from("<d", self.mm, 8 * SLOTS.index(name))
        return now - max(stamp, self.since[name])

    def stalled(self) -> Optional[tuple[str, float]]:
        """The first child silent past the timeout (name, seconds); logs approaching ones."""
        now = time.monotonic()
        for name in self.since:
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
