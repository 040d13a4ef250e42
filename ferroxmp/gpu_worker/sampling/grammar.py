"""Structured output in the worker: one grammar matcher per constrained row, and the
token bitmasks that confine its next token to what the grammar allows.

Job: compile a request's Grammar (json_object, json_schema, regex, ebnf, lark) with
llguidance against this checkpoint's vocabulary (an LRU of compiled matchers keyed by
a hash of kind + spec), keep a row's matcher in step with the tokens the worker
samples for it, and write its bitmask for the next step (the sampler's
`apply_bitmask` turns bitmasks into -inf logits).

Why llguidance (it replaced xgrammar; tools/bench_grammar.py, docs/BENCHMARKS.md):
xgrammar precomputes per vocabulary token at compile time, so a schema of 1,200
optional properties took ~19 s (minutes for 3,000) inside the batch loop; llguidance
builds lazily (3,000 properties: 0.87 s to the first mask) and bounds its own work
(LLParserLimits). It is exact on JSON Schema: no raw control bytes or broken UTF-8 in
strings, maxLength counted in characters, and a keyword it cannot enforce is an error
naming it (so the frontend refuses it with a 400). Its per-step mask is slower
(~90 us vs 18 us on a 49k vocabulary), paid per constrained decode step.

Compiling happens off the batch loop (sampling/grammar_prep.py warms this cache in a thread:
llguidance drops the GIL); `matcher` compiles inline only for a spec evicted between
its preparation and its row, within the same LLParserLimits.

Invariants:
- Only the model's EOS ids are stop tokens, allowed only where the grammar accepts;
  once the grammar is complete only they are allowed, so the row stops ("stop").
- Special tokens other than EOS and the padding ids past the tokenizer's vocabulary
  are never allowed (their bytes are given as empty).
- A row's matcher is a copy of the compiled one: tokens generated before a
  retraction (after prompt_len) are replayed into it, so retraction, abort and a
  reused row slot never see another row's state.
- JSON rows never get a raw control byte inside a string (llguidance's JSON lexer is
  exact; tests/test_grammar_walk.py checks it by random walks).
- A matcher that has accepted its stop token (a step the scheduler sent before it
  saw the finish) allows only EOS and ignores what it is fed: that token is dropped.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import llguidance as llg
import torch

from ferroxmp.grammar_spec import GrammarError, _short, limits, spec_key, to_llguidance
from ferroxmp.protocol import Grammar

CACHE_SIZE = 256  # compiled grammars kept (by hash of kind + spec)


class GrammarCache:
    """llguidance's tokenizer for one vocabulary, with an LRU of compiled matchers."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int, eos_ids: Sequence[int], encode=None):
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        toks = list(token_bytes) + [b""] * (vocab_size - len(token_bytes))
        wrapper = _Vocab(toks, self.eos_ids, encode)
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(wrapper), n_vocab=vocab_size,
                                         eos_token=self.eos_ids)
        self._cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # how many specs were compiled (tests: the cache is used)

    @classmethod
    def for_checkpoint(cls, model_path: str, vocab_size: int, eos_ids: Sequence[int]) -> "GrammarCache":
        from ferroxmp.checkpoint.text_codec import TextCodec  # the tokenizer only, no transformers
        codec = TextCodec(model_path)
        n = min(codec.vocab_size, vocab_size)
        toks = [b"" if codec.is_special(i) and i not in eos_ids else codec.token_bytes(i) for i in range(n)]
        return cls(toks, vocab_size, eos_ids, encode=lambda b: codec.encode(b.decode("utf-8", "replace"), add_special_tokens=False))

    def cached(self, g: Grammar) -> bool:
        with self._lock:
            return spec_key(g) in self._cache

    def compile(self, g: Grammar) -> tuple[llg.LLMatcher, bool, float]:
        """(compiled matcher, was cached, seconds spent compiling). The matcher is built
        and its first mask computed (llguidance builds lazily: the first mask is where a
        large schema costs), outside the lock, so the GIL and other specs are free."""
        key = spec_key(g)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key], True, 0.0
        t0 = time.perf_counter()
        m = llg.LLMatcher(self.tokenizer, to_llguidance(g), log_level=0, limits=limits())
        if not m.is_error():
            m.compute_bitmask()
        if m.is_error():
            raise GrammarError(f"cannot compile the {g.kind} grammar: {_short(m.get_error())}")
        with self._lock:
            self.compiles += 1
            self._cache[key] = m
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return m, False, time.perf_counter() - t0

    def matcher(self, g: Grammar, generated: Sequence[int] = ()) -> "RowGrammar":
        """A fresh matcher for one row, advanced over the tokens it already generated."""
        rg = RowGrammar(self.compile(g)[0].deep_copy(), self.eos_ids)
        for i, tok in enumerate(generated):
            if rg.done:
                break
            if not rg.matcher.consume_token(int(tok)):
                raise GrammarError(f"generated token {tok} (#{i}) does not fit the row's grammar: "
                                   f"{_short(rg.matcher.get_error())}")
        return rg


@dataclass
class _Vocab:
    """What llguidance's TokenizerWrapper reads: token bytes, EOS, and an encoder (the
    engine tokenizes some literal text when it builds a grammar; without the
    checkpoint's encoder a byte-per-token fallback is used, still correct but slower)."""
    tokens: list[bytes]
    eos: list[int]
    encode: object = None

    @property
    def eos_token_id(self) -> int:
        return self.eos[0]

    bos_token_id = None

    @property
    def special_token_ids(self) -> list[int]:
        return list(self.eos)

    def __call__(self, s):
        b = s if isinstance(s, bytes) else s.encode()
        if self.encode is None:
            return self._greedy(b)
        return self.encode(b)

    def _greedy(self, b: bytes) -> list[int]:
        """Longest-match tokenization over the token bytes (tests and tools only)."""
        if not hasattr(self, "_by_bytes"):
            self._by_bytes = {t: i for i, t in enumerate(self.tokens) if t and i not in self.eos}
            self._longest = max(map(len, self._by_bytes))
        out, i = [], 0
        while i < len(b):
            for n in range(min(self._longest, len(b) - i), 0, -1):
                if (tok := self._by_bytes.get(b[i:i + n])) is not None:
                    out.append(tok)
                    i += n
                    break
            else:
                raise ValueError(f"byte {b[i]:#x} has no token")
        return out


@dataclass
class RowGrammar:
    """One row's matcher."""
    matcher: llg.LLMatcher
    eos_ids: list[int]

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Write this row's allowed-next-token bits into bitmask[index]."""
        row = bitmask[index]
        if self.done:
            row.zero_()
            for t in self.eos_ids:
                row[t // 32] |= _bit(t % 32)
            return
        assert row.is_contiguous() and row.dtype == torch.int32 and row.device.type == "cpu"
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {_short(self.matcher.get_error())}")

    def advance(self, token: int) -> None:
        """Feed the sampled token. The mask only allowed tokens the matcher accepts, so
        a refusal here means a bug; it is raised, not ignored."""
        if self.done:
            return
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"sampled token {token} does not fit the grammar: "
                               f"{_short(self.matcher.get_error())}")


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def _pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool [vocab] -> int32 [ceil(vocab/32)] in the engine's layout (bit t % 32 of word t // 32)."""
    words = (allowed.numel() + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:allowed.numel()] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def allocate(n: int, vocab_size: int) -> torch.Tensor:
    return torch.full((n, (vocab_size + 31) // 32), -1, dtype=torch.int32)
