"""The seeded workloads of tools/bench_serving.py: prompts of common words, output lengths,
arrival times. The same seed gives the same jobs for every server."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Short common words: most BPE vocabularies give " word" one token, so a prompt of
# N words is roughly N tokens. The report uses the server's count, not N.
WORDS = (
    "the of and to in is was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do "
    "will each about how up out them then she many some so these would other into has "
    "more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words "
    "called just where most know get through back much before go good new write our "
    "used me man too any day same right look think also around another came come work "
    "three must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every"
).split()


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, num_words)))


def spread(rng: random.Random, length: int, ratio: float) -> int:
    """A length drawn uniformly from [length*(1-ratio), length*(1+ratio)], at least 1."""
    low, high = int(length * (1 - ratio)), int(math.ceil(length * (1 + ratio)))
    return max(1, rng.randint(low, high))


@dataclass
class Job:
    """What one client sends in order: one turn, or every turn of a conversation."""
    questions: list[str]
    output_lens: list[int]
    system: str | None = None
    group: int = 0


def random_jobs(rng: random.Random, num_prompts: int, input_len: int, output_len: int,
                range_ratio: float) -> list[Job]:
    return [Job([random_text(rng, spread(rng, input_len, range_ratio))],
                [spread(rng, output_len, range_ratio)]) for _ in range(num_prompts)]


def shared_prefix_jobs(rng: random.Random, num_groups: int, prompts_per_group: int,
                       system_prompt_len: int, question_len: int, output_len: int) -> list[Job]:
    """Groups of prompts that share one long system prompt, shuffled so groups interleave."""
    jobs = []
    for group in range(num_groups):
        system = random_text(rng, system_prompt_len)
        jobs += [Job([random_text(rng, question_len)], [output_len], system, group)
                 for _ in range(prompts_per_group)]
    rng.shuffle(jobs)
    return jobs


def multi_turn_jobs(rng: random.Random, num_conversations: int, num_turns: int,
                    input_len: int, output_len: int, range_ratio: float) -> list[Job]:
    return [Job([random_text(rng, spread(rng, input_len, range_ratio)) for _ in range(num_turns)],
                [spread(rng, output_len, range_ratio) for _ in range(num_turns)], group=c)
            for c in range(num_conversations)]


def copy_text_jobs(rng: random.Random, num_prompts: int, input_len: int, output_len: int) -> list[Job]:
    """An input-grounded load (speculative decoding's case): each request asks to repeat a
    given text of `input_len` words, so a faithful answer copies its prompt."""
    return [Job([f"Repeat the following text exactly, word for word:\n\n{random_text(rng, input_len)}"],
                [output_len]) for _ in range(num_prompts)]


def poisson_arrivals(rng: random.Random, count: int, rate: float) -> list[float]:
    """Send offsets in seconds: exponential gaps at `rate` per second; all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * count
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def cycle_prefix_jobs(rng: random.Random, num_prefixes: int, prefix_len: int, rounds: int,
                      question_len: int, output_len: int) -> list[Job]:
    """`num_prefixes` distinct long system prompts, each used once per round, every round in
    the same order (0, 1, ..., N-1, 0, 1, ...). With N * prefix_len tokens beyond the KV pool,
    an LRU pool has evicted each prefix before it comes round again: the worst case for a
    pool-only cache, the one KV tiers exist for. Questions differ, so only the prefix repeats."""
    systems = [random_text(rng, prefix_len) for _ in range(num_prefixes)]
    return [Job([random_text(rng, question_len)], [output_len], systems[p], p)
            for _ in range(rounds) for p in range(num_prefixes)]
