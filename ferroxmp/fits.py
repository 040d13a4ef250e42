"""Whether a request fits the model's context: the one rule and its one message.

Used by the frontend (a 400 before anything is tokenized further or queued: the
prompt's ids, a text's lower bound of tokens, prompt + max_tokens) and by the scheduler
(its refusal for whatever reaches it). A prompt fits when at least one completion
token still fits after it; with max_tokens, when both do.
"""
from __future__ import annotations

from typing import Optional


def context_refusal(prompt_tokens: int, max_tokens: Optional[int], max_model_len: int,
                    at_least: bool = False) -> Optional[str]:
    """Why `prompt_tokens` (+ `max_tokens`, when given) cannot fit in `max_model_len`
    tokens, or None. `at_least`: prompt_tokens is a lower bound (a text not tokenized)."""
    more = 1 if max_tokens is None else max_tokens
    if prompt_tokens + more <= max_model_len:
        return None
    head = f"this model's maximum context length is {max_model_len} tokens (prompt + completion); "
    if max_tokens is None or prompt_tokens >= max_model_len:
        return head + f"the prompt has {'at least ' if at_least else ''}{prompt_tokens} tokens: shorten the prompt"
    return head + (f"the prompt has {prompt_tokens} and max_tokens asks for {max_tokens} more: "
                   f"shorten the prompt or lower max_tokens")
