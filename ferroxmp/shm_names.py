"""Names of ferroxmp's shared-memory segments, and the removal of dead servers' ones.

A server's page pool lives in /dev/shm. Normally the worker unlinks it on the way
out, and the supervisor again at teardown; but after `kill -9` of every process of a
server nothing runs that could, and the segment stays until reboot. So the name says
who owns it: `fxmp_<pid>_<start>_<random>`, the supervisor's pid and its start time
(field 22 of /proc/PID/stat, clock ticks since boot). A pid can be reused by an
unrelated process; pid + start time cannot. `ferroxmp serve` removes, before it
creates its own, every such segment of this user whose owner is gone, one log line
each (removed through page_pool.py, the one module that creates and removes segments).

Invariants: a segment whose owner lives (same pid AND same start time) is never
touched; a name this module cannot parse is never touched; an older name without a
start time (`fxmp_<pid>_<random>`, PagePool.create's default) is removed only when
no process has that pid at all.
"""
from __future__ import annotations

import glob
import logging
import os
import secrets
from typing import Optional

PREFIX = "fxmp_"
SHM_DIR = "/dev/shm"
log = logging.getLogger("ferroxmp.supervisor")


def process_start(pid: int) -> Optional[int]:
    """When `pid` started (clock ticks since boot), or None if no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def segment_name(pid: Optional[int] = None) -> str:
    """A fresh segment name owned by `pid` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return f"{PREFIX}{pid}_{process_start(pid) or 0}_{secrets.token_hex(4)}"


def owner(name: str) -> Optional[tuple[int, Optional[int]]]:
    """(pid, start time or None for the older format), or None if not ours to judge."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX):].split("_")
    try:
        if len(parts) == 3:
            return int(parts[0]), int(parts[1])
        if len(parts) == 2:
            return int(parts[0]), None
    except ValueError:
        pass
    return None


def owner_alive(pid: int, start: Optional[int]) -> bool:
    started = process_start(pid)
    if started is None:
        return os.path.exists(f"/proc/{pid}")  # unreadable stat but there: assume alive
    return start is None or started == start


def remove_dead_segments() -> list[str]:
    """Unlink this user's ferroxmp segments whose owner is gone; returns their names."""
    from ferroxmp.page_pool import remove_segment  # numpy with it: `ferroxmp serve` runs this in a child
    removed = []
    for path in sorted(glob.glob(os.path.join(SHM_DIR, PREFIX + "*"))):
        name = os.path.basename(path)
        who = owner(name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if who is None or st.st_uid != os.getuid() or owner_alive(*who):
            continue
        try:
            remove_segment(name)
        except OSError as e:
            log.warning("could not remove shared-memory segment %s left by a dead server: %s", path, e)
            continue
        removed.append(name)
        log.info("removed shared-memory segment %s (%d bytes) left by a dead server (pid %d%s)", path,
                 st.st_size, who[0], "" if who[1] is None else f", started at tick {who[1]}")
    return removed
