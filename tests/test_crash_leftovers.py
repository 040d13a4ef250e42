"""Crash leftovers: a server killed with -9 (every process) leaves its shared-memory
pool in /dev/shm; the next `ferroxmp serve` removes it, and only it.

Measured before this: after `kill -9` of every process of a server its segments stayed
in /dev/shm until reboot, and later servers did not notice. Oracles: the segment's
existence in /dev/shm before and after, the log line naming it, and two planted
segments — one whose owner (this test process, same pid, same start time) lives and
must stay, one naming this pid with another start time (a reused pid) that must go.
"""
from __future__ import annotations

import glob
import os
import signal
import time

from ferroxmp.shm_names import process_start
from serverproc import ServerProcess, serving

FLAGS = ("--page-size", "4", "--kv-pages", "64", "--max-running-requests", "2")


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (children of children too: the resource tracker)."""
    parents: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def _kill_every_process(srv: ServerProcess) -> None:
    """SIGSTOP all first (so none sees another die and cleans up), then SIGKILL all."""
    pids = _descendants(srv.proc.pid)
    assert len(pids) >= 4, pids  # supervisor, worker, scheduler, frontend
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    for p in pids:
        os.kill(p, signal.SIGKILL)
    srv.proc.wait()
    deadline = time.time() + 10
    while any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids) and time.time() < deadline:
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def test_a_new_server_removes_the_pool_of_a_server_killed_with_minus_9_and_nothing_alive(tiny_models):
    me, start = os.getpid(), process_start(os.getpid())
    live = f"/dev/shm/fxmp_{me}_{start}_feedc0de"  # owner alive: must stay
    reused = f"/dev/shm/fxmp_{me}_{start + 1}_deadbeef"  # same pid, other start: a dead owner
    dead = ServerProcess(tiny_models["llama"], *FLAGS)
    try:
        _kill_every_process(dead)
        left = glob.glob(f"/dev/shm/fxmp_{dead.proc.pid}_*")
        assert len(left) == 1, f"kill -9 of every process should leave the pool behind: {left}"
        for path in (live, reused):
            with open(path, "wb") as f:
                f.write(b"\0" * 64)
        with serving(tiny_models["llama"], *FLAGS) as fresh:
            log = fresh.log()
            own = glob.glob(f"/dev/shm/fxmp_{fresh.proc.pid}_*")
            assert len(own) == 1 and own[0].split("_")[2] == str(process_start(fresh.proc.pid)), own
        assert not os.path.exists(left[0]), "the dead server's pool is still in /dev/shm"
        assert f"removed shared-memory segment {left[0]}" in log, log
        assert not os.path.exists(reused), "a segment of a reused pid (other start time) was kept"
        assert os.path.exists(live), "a segment whose owner lives was removed"
        assert os.path.basename(live) not in log
    finally:
        for path in [live, reused] + glob.glob(f"/dev/shm/fxmp_{dead.proc.pid}_*"):
            if os.path.exists(path):
                os.unlink(path)
        dead.stop()
