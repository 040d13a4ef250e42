"""Prompt-lookup drafts for `--speculative-ngram`, and when to stop offering them.

Job: `propose(tokens, k)` finds the latest earlier occurrence of the row's last n tokens
(n = MAX_N down to MIN_N) in its own prompt and output, and proposes the (up to) k tokens
that followed it. Outputs that copy their input (a rewrite, a code edit, an answer
quoting its context) are continued from the input; elsewhere nothing matches and the
row decodes as usual. A match less than k tokens back means the text repeats with that
period (a list's pattern, a model's loop: "take take take", "of two very different of
two very different"): the draft goes on around the cycle to k tokens, where the tokens
that followed the match alone would stop at the row's end (one token a step for a
one-token loop). The runner verifies a draft in the row's next step: one pass over
the weights for k + 1 positions instead of one.

`Backoff` keeps a row that keeps having its drafts rejected from paying for them: after
a draft with nothing accepted the row skips drafting for 1, then 3, 7, 15 steps (an
accepted token resets it), so a load with no copying costs little beyond the search.
It also sizes the next draft (`length`): twice the tokens its drafts had accepted
lately, plus one (`run`, halved toward each new draft's count), so a draft accepted
whole lets the next be about twice as long. Why: where a verify's tokens are computed,
not read (int4 on a CPU, ~0.25 of a step per drafted token, docs/BENCHMARKS.md 28), a
long draft pays only while it is accepted: copying runs accept long drafts whole or
nearly (the longest the step allows is best: a copy load 13% faster at 15 than at 8),
while a row whose drafts break after a token or two keeps offering short ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_N, MIN_N = 3, 2  # n-gram lengths tried, longest first (1 token matches too much at random)
MAX_SKIP = 15


def propose(tokens, k: int) -> list[int]:
    a = np.asarray(tokens)  # the row's int32 buffer as it is: no copy
    size = len(a)
    for n in range(MAX_N, MIN_N - 1, -1):
        if size <= n:
            continue
        tail = a[size - n:]
        hit = a[:size - n] == tail[0]  # starts i < size - n: something follows the match
        for j in range(1, n):
            hit &= a[j:size - n + j] == tail[j]
        found = np.flatnonzero(hit)
        if len(found):
            start = int(found[-1]) + n
            return np.resize(a[start:start + k], k).tolist()  # resize repeats a short cycle
    return []


FIRST_RUN = 3.5  # a row's first draft: 2 * 3.5 + 1 = 8 tokens


@dataclass
class Backoff:
    skip: int = 0  # steps to go without drafting
    span: int = 0  # the next skip after a wholly rejected draft
    run: float = FIRST_RUN  # tokens accepted a draft, lately (each draft's count weighs half)

    @property
    def length(self) -> int:
        """The next draft's most tokens (the scheduler's budget caps it: --num-speculative-tokens)."""
        return int(2 * self.run) + 1

    def wants_draft(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.run = (self.run + accepted) / 2
        if accepted:
            self.span = 0
        elif drafted:
            self.span = min(2 * self.span + 1, MAX_SKIP)
            self.skip = self.span
