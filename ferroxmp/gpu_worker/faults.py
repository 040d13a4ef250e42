"""Test-only fault injection for the worker, read once from FERROXMP_FAULT_INJECT.

Tests use it to prove that a failing forward or row ends only the requests it
touches and never hangs the server. Unset (always, in production) it is `None`
and each hook is one `is None` check per batch.

    FERROXMP_FAULT_INJECT="forward_raise_token=7;forward_hang_token=9:30;sample_raise_seed=666"

- forward_raise_token=T: a forward whose input holds token id T raises.
- forward_hang_token=T:S: a forward whose input holds token id T sleeps S seconds
  (a stuck process: the supervisor's stall timeout must catch it).
- forward_busy_token=T:S: a forward whose input holds token id T computes (burns CPU)
  for S seconds: a slow step, which the stall watchdog must NOT take for a stall.
- forward_busy_per_token=S: every forward burns S seconds of CPU per input token (a
  slow machine: the scheduler's step budget must shrink its chunks to fit).
- sample_raise_seed=S: sampling a row whose seed is S raises (a row the worker
  cannot compute, among healthy ones).
- grammar_compile_sleep=S: compiling a grammar whose spec holds the text
  FERROXMP_SLOW_COMPILE (e.g. in a schema's description) first sleeps S seconds on
  its compile thread (a slow compile: other rows must keep stepping meanwhile).
- kv_disk_sleep=S: every page file the KV disk tier reads or writes first sleeps S
  seconds (a slow disk: loads and stores must never slow the batch loop).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger("ferroxmp.worker")
ENV = "FERROXMP_FAULT_INJECT"
SLOW_COMPILE = "FERROXMP_SLOW_COMPILE"


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Faults:
    forward_raise_token: Optional[int] = None
    forward_hang_token: Optional[int] = None
    forward_hang_s: float = 0.0
    forward_busy_token: Optional[int] = None
    forward_busy_s: float = 0.0
    forward_busy_per_token: float = 0.0
    sample_raise_seed: Optional[int] = None
    grammar_compile_sleep: float = 0.0
    kv_disk_sleep: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "Faults":
        kw: dict = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            key, _, value = part.partition("=")
            if key == "forward_raise_token":
                kw["forward_raise_token"] = int(value)
            elif key == "forward_hang_token":
                token, _, seconds = value.partition(":")
                kw["forward_hang_token"], kw["forward_hang_s"] = int(token), float(seconds or 3600)
            elif key == "forward_busy_token":
                token, _, seconds = value.partition(":")
                kw["forward_busy_token"], kw["forward_busy_s"] = int(token), float(seconds or 10)
            elif key == "forward_busy_per_token":
                kw["forward_busy_per_token"] = float(value)
            elif key == "sample_raise_seed":
                kw["sample_raise_seed"] = int(value)
            elif key == "grammar_compile_sleep":
                kw["grammar_compile_sleep"] = float(value)
            elif key == "kv_disk_sleep":
                kw["kv_disk_sleep"] = float(value)
            else:
                raise ValueError(f"{ENV}: unknown fault {key!r}")
        return cls(**kw)

    def before_forward(self, ids) -> None:  # the step's input ids (an int array)
        if self.forward_hang_token is not None and self.forward_hang_token in ids:
            log.warning("fault injection: forward hangs for %.0fs", self.forward_hang_s)
            time.sleep(self.forward_hang_s)
        busy = self.forward_busy_per_token * len(ids)
        if self.forward_busy_token is not None and self.forward_busy_token in ids:
            log.warning("fault injection: forward computes for %.0fs", self.forward_busy_s)
            busy += self.forward_busy_s
        if busy > 0:
            _burn(busy)
        if self.forward_raise_token is not None and self.forward_raise_token in ids:
            raise InjectedFault(f"injected forward failure (token {self.forward_raise_token})")

    def before_grammar_compile(self, spec: str) -> None:
        if self.grammar_compile_sleep > 0 and SLOW_COMPILE in spec:
            log.warning("fault injection: grammar compile sleeps %.1fs", self.grammar_compile_sleep)
            time.sleep(self.grammar_compile_sleep)

    def before_disk_io(self) -> None:
        if self.kv_disk_sleep > 0:
            time.sleep(self.kv_disk_sleep)

    def before_sample(self, seeds: Sequence[int]) -> None:
        if self.sample_raise_seed is not None and self.sample_raise_seed in seeds:
            raise InjectedFault(f"injected sampling failure (seed {self.sample_raise_seed})")


def _burn(seconds: float) -> None:
    """Use a core for `seconds` (CPU time advances, as in a real long forward)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(2000))


def from_env() -> Optional[Faults]:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    faults = Faults.parse(spec)
    log.warning("FAULT INJECTION ACTIVE (test only): %s", faults)
    return faults
