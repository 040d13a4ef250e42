"""FrontendState: what every HTTP thread of the frontend shares.

The configuration (ServerArgs as a dict, the worker's facts, process ids), the
text codec, the bridge to the scheduler and the metrics, plus two pieces of
lifecycle state: `draining` (SIGTERM seen: refuse new work) and `in_flight`
(generation requests not yet fully answered; the drain waits for it to reach 0).
Invariant: every `begin()` is matched by exactly one `end()`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ferroxmp.config import ServerArgs
from ferroxmp.frontend.bridge import Bridge
from ferroxmp.frontend.metrics import Metrics
from ferroxmp.frontend.text.tokenizer import TextCodec


@dataclass
class FrontendState:
    args: dict
    worker_info: dict
    pids: dict
    codec: TextCodec
    bridge: Bridge
    metrics: Metrics
    started: float = field(default_factory=time.time)
    draining: bool = False
    in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def model_name(self) -> str:
        return ServerArgs.from_dict(self.args).model_name

    @property
    def max_model_len(self) -> int:
        return int(self.worker_info["max_model_len"])

    @property
    def pool_tokens(self) -> Optional[int]:
        """Tokens the whole KV pool holds: no single request can be longer."""
        pages, size = self.worker_info.get("num_pages"), self.worker_info.get("page_size")
        return int(pages) * int(size) if pages and size else None

    @property
    def vocab_size(self) -> int:
        return int(self.worker_info.get("vocab_size") or self.codec.vocab_size)

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1
        self.check_integrity()

    def check_integrity(self) -> None:
        if self.in_flight < 0:
            raise AssertionError(f"in_flight went negative ({self.in_flight}): a request ended twice")
