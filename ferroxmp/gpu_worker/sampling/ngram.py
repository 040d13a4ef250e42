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
It also sizes the next draft (`length`): doubled after a draft accepted whole, halved
(but at least the accepted run and one more) after one cut short. Why: where a verify's
tokens are computed, not read (int4 on a CPU, ~0.25 of a step per drafted token,
docs/BENCHMARKS.md 28), a long draft pays only while it is accepted: copying runs accept
every token (then the longest draft the step allows is best), and a row whose drafts
break early keeps offering short ones.
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


MAX_LENGTH = 16  # the most a draft can be (--num-speculative-tokens caps it further)
FIRST_LENGTH = 8  # a row's first draft


@dataclass
class Backoff:
    skip: int = 0  # steps to go without drafting
    span: int = 0  # the next skip after a wholly rejected draft
    length: int = FIRST_LENGTH  # the next draft's most tokens

    def wants_draft(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def verified(self, drafted: int, accepted: int) -> None:
        if accepted == drafted and drafted:
            self.length = min(2 * max(self.length, drafted), MAX_LENGTH)
        elif drafted:
            self.length = max(self.length // 2, accepted + 1)
        if accepted:
            self.span = 0
        elif drafted:
            self.span = min(2 * self.span + 1, MAX_SKIP)
            self.skip = self.span
