"""StepBudget: how many prefill tokens one step may carry so that it lasts about
`--max-step-seconds` on this machine, in this dtype, at this load.

A step's time is roughly overhead + tokens x per-token cost, and both depend on the
machine (emulated bf16 is ~6x slower than float32 on AVX2), the model and how busy
the cores are. So the budget is measured, not configured: an EWMA of the tokens and
of the seconds of each step the worker reports (`BatchResult.compute_s`) gives a
speed, and the step's token budget is speed x target, between `floor` and
`--max-batch-tokens`. Measuring at budget B gives B / (overhead + cost x B), so the
budget settles where a step takes the target: (target - overhead) / cost.

Invariants: decode rows are never cut by the budget (a stream must keep flowing; the
budget only bounds the prefill chunks that ride with them), and a prefill always
gets at least `floor` tokens, so a long prompt progresses however slow the machine.
Chunking never changes an answer (a chunk continues at its cursor, same positions).
Until a step of at least LEARN_MIN_TOKENS was measured the budget is the ceiling:
the server behaves as without the bound (the stall watchdog reads CPU time, so a
first long step is not taken for a stall). target_s 0 switches the bound off.
"""
from __future__ import annotations

from dataclasses import dataclass

LEARN_MIN_TOKENS = 32  # smaller steps are mostly per-step overhead: they say little of prefill speed
ALPHA = 0.3  # weight of the newest step: a few steps follow a change of load


@dataclass
class StepBudget:
    target_s: float  # --max-step-seconds; 0 = no time bound
    ceiling: int  # --max-batch-tokens
    floor: int = 16
    tokens: float = 0.0  # EWMA of tokens per measured step
    seconds: float = 0.0  # EWMA of seconds per measured step

    def observe(self, tokens: int, seconds: float) -> None:
        """One step's size and the worker's compute time for it."""
        if tokens < LEARN_MIN_TOKENS or seconds <= 0.0:
            return
        if self.seconds == 0.0:
            self.tokens, self.seconds = float(tokens), seconds
        else:
            self.tokens += ALPHA * (tokens - self.tokens)
            self.seconds += ALPHA * (seconds - self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0.0 else 0.0

    @property
    def step_tokens(self) -> int:
        """Tokens one step may hold now (exported as ferroxmp_step_token_budget)."""
        if self.target_s <= 0.0 or self.seconds == 0.0:
            return self.ceiling
        return max(min(self.floor, self.ceiling), min(self.ceiling, int(self.tokens_per_s * self.target_s)))

    def prefill_allowance(self, n_decode: int) -> int:
        """Prefill tokens a step with `n_decode` decode rows may add: what is left of the
        step's tokens after them, but never less than `floor`."""
        return max(min(self.floor, self.ceiling), self.step_tokens - n_decode)
