"""RouterArgs: every flag of `ferroxmp router`, one dataclass field each (same name, dashes)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from ferroxmp.router.policy import POLICIES


def _f(default: Any, help: str, **kw) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class RouterArgs:
    backend: list = _f(None, "A ferroxmp server's base URL, http://HOST:PORT (repeat for each).",
                       action="append", required=True)
    host: str = _f("127.0.0.1", "Address the router binds.")
    port: int = _f(30100, "HTTP port.")
    policy: str = _f("cache-aware", "How a backend is chosen.", choices=list(POLICIES))
    balance_abs_threshold: int = _f(32, "cache-aware: the matching backend is overloaded when its load exceeds "
                                    "the least loaded's by more than this many requests ...")
    balance_rel_threshold: float = _f(1.5, "... and by more than this factor; it then goes to the least loaded.")
    cache_threshold: float = _f(0.3, "cache-aware: the fraction of a request's blocks the best backend must hold "
                                "for affinity; below it the request goes to the least loaded.")
    block_chars: int = _f(32, "Characters per prefix-tree block (the router's stand-in for a KV page).")
    tree_max_blocks: int = _f(65536, "Blocks each backend's prefix tree keeps; least recently used go first.")
    health_interval: float = _f(1.0, "Seconds between polls of each backend's /health and /metrics.")
    health_timeout: float = _f(2.0, "Seconds a poll waits for a backend.")
    upstream_timeout: float = _f(600.0, "Seconds a proxied request may wait on a backend's socket.")
    api_key: Optional[str] = _f(None, "Require 'Authorization: Bearer KEY' on /v1 and /generate; the client's "
                                "Authorization header is forwarded to the backend either way.")
    backend_api_key: Optional[str] = _f(None, "Key the router sends as 'Authorization: Bearer KEY' when it polls each "
                                        "backend's /metrics (a backend started with --api-key refuses it "
                                        "otherwise); default: --api-key. Also FERROXMP_BACKEND_API_KEY.")
    http_threads: int = _f(256, "HTTP worker threads (each streaming client holds one).")
    max_body_bytes: int = _f(64 * 1024 * 1024, "Largest request body accepted (413 beyond).")
    shutdown_grace: float = _f(30.0, "Seconds SIGTERM waits for proxied requests to finish.")
    log_level: str = _f("info", "Log level.", choices=["debug", "info", "warning", "error"])

    def validate(self) -> None:
        """Raise ValueError('--flag: why') for the first bad value."""
        from ferroxmp.router.backends import Backend
        from ferroxmp.router.tree import PrefixTree
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port: {self.port} is not a TCP port")
        for name in ("block_chars", "tree_max_blocks", "http_threads", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
        for name in ("health_interval", "health_timeout", "upstream_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be > 0")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold: must be within [0, 1]")
        if len(set(self.backend)) != len(self.backend):
            raise ValueError("--backend: the same URL given twice")
        for url in self.backend:
            try:
                Backend(url, PrefixTree())
            except ValueError as e:
                raise ValueError(f"--backend: {e}") from None


def parse_router_args(argv: list[str]) -> RouterArgs:
    parser = argparse.ArgumentParser(prog="ferroxmp router",
                                     description="One OpenAI-compatible address in front of ferroxmp servers.")
    for f in dataclasses.fields(RouterArgs):
        kw = {k: v for k, v in f.metadata.items() if k != "help"}
        if "action" not in kw:
            kw["type"] = float if f.type == "float" else int if f.type == "int" else str
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=f.metadata["help"], **kw)
    args = RouterArgs(**vars(parser.parse_args(argv)))
    try:
        args.validate()
    except ValueError as e:
        parser.error(str(e))
    return args
