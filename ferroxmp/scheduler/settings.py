"""SchedulerConfig: the scheduler's knobs (from `launch.json`) and the refusals they
imply — a request that can never fit is refused at once, never queued."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ferroxmp.config import ServerArgs
from ferroxmp.fits import context_refusal
from ferroxmp.protocol import SamplingParams
from ferroxmp.scheduler.cache import pages_for


@dataclass
class SchedulerConfig:
    page_size: int
    max_batch_tokens: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    queue_timeout: float = 600.0
    radix: bool = True
    sliding_window: Optional[int] = None
    swa_release_interval: int = 32
    aging_s: float = 5.0
    seed: int = 0
    max_step_seconds: float = 0.0  # 0: steps bounded by max_batch_tokens only (step_budget.py)
    max_grammar_compile_seconds: float = 5.0  # a grammar still pending after this is a 400
    kv_host: bool = False  # a host-memory tier below the pool (--kv-host-gb)
    kv_disk: bool = False  # a disk tier (--kv-cache-dir)
    spec_tokens: int = 0  # speculation's most draft tokens, or --decode-steps - 1, per row and step (0: off)
    decode_steps: bool = False  # spec_tokens are --decode-steps' further steps, not drafts
    spec_step_tokens: Optional[int] = None  # the worker's: most tokens a step verifies (rows + drafts); None: no cap

    @classmethod
    def from_launch(cls, args: dict, worker_info: dict) -> "SchedulerConfig":
        server = ServerArgs.from_dict(args)
        # --decode-steps where the worker's fused step runs them (its own figure: 1 elsewhere)
        steps = min(server.decode_steps, worker_info.get("decode_steps", 1))
        return cls(page_size=worker_info["page_size"], max_batch_tokens=args["max_batch_tokens"],
                   max_model_len=worker_info["max_model_len"], vocab_size=worker_info["vocab_size"],
                   eos_token_ids=tuple(worker_info.get("eos_token_ids") or ()),
                   queue_timeout=args["queue_timeout"], radix=not args["disable_radix_cache"],
                   sliding_window=worker_info.get("sliding_window"),
                   swa_release_interval=args["swa_release_interval"], seed=args.get("seed", 0),
                   max_step_seconds=args.get("max_step_seconds", 0.0),
                   max_grammar_compile_seconds=args.get("max_grammar_compile_seconds", 5.0),
                   kv_host=bool(args.get("kv_host_gb")), kv_disk=bool(args.get("kv_cache_dir")),
                   spec_tokens=server.spec_tokens if server.decode_steps == 1 else steps - 1,
                   decode_steps=steps > 1,
                   spec_step_tokens=worker_info.get("spec_step_tokens"))

    def refusal(self, p: SamplingParams, n: int, num_pages: int) -> Optional[str]:
        """Why a request of n prompt tokens can never run here (400), or None."""
        limit = self.max_model_len
        if n == 0:
            return "the prompt is empty: send at least one token"
        if p.max_tokens < 1:
            return f"max_tokens must be at least 1, got {p.max_tokens}"
        if (why := context_refusal(n, p.max_tokens, limit)) is not None:
            return why
        if pages_for(n + p.max_tokens, self.page_size) > num_pages:
            return (f"prompt ({n}) + max_tokens ({p.max_tokens}) needs more KV pages than the whole "
                    f"pool holds ({num_pages} x {self.page_size} tokens)")
        return None
