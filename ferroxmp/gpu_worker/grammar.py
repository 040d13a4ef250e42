"""Structured output in the worker: one grammar matcher per constrained row, and the
token bitmasks that confine its next token to what the grammar allows.

Job: compile a request's Grammar (json_object, json_schema, regex, ebnf) with xgrammar
against this checkpoint's vocabulary (cached by spec), keep a row's matcher in step
with the tokens the worker samples for it, and write its bitmask for the next step
(the sampler's `apply_bitmask` turns bitmasks into -inf logits).

Why xgrammar: measured against llguidance 1.9.1 on the same vocabularies
(tools/bench_grammar.py; CPU shared with other jobs): the per-step mask, paid on
every decode step of a constrained row, is 9 us vs 224 us (tiny, 1k vocab) and 18 us vs 90 us (SmolLM2,
49k vocab); llguidance compiles faster (1-2 ms vs 4-24 ms), but compiling happens
once per spec and is cached. xgrammar also reads EBNF (SGLang's `ebnf`) natively.

Invariants:
- Only the model's EOS ids are stop tokens, allowed only where the grammar accepts;
  once the grammar is complete only they are allowed, so the row stops ("stop").
- Special tokens other than EOS and the padding ids past the tokenizer's vocabulary
  are never allowed (their bytes are given as empty).
- A row's matcher is built fresh from its NewRow: tokens generated before a
  retraction (after prompt_len) are replayed into it, so retraction, abort and a
  reused row slot never see another row's state.
- JSON rows never get a token holding a raw control byte (xgrammar's JSON strings
  admit them; JSON does not).
- A matcher that has accepted its stop token (a step the scheduler sent before it
  saw the finish) allows only EOS and ignores what it is fed: that token is dropped.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import xgrammar as xgr

from ..protocol import Grammar

CACHE_SIZE = 256  # compiled grammars kept (by kind + spec)


class GrammarError(ValueError):
    """A spec the engine cannot compile, or a replayed token the grammar refuses."""


class GrammarCache:
    """xgrammar's compiler for one vocabulary, with an LRU of compiled grammars."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int, eos_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        info = xgr.TokenizerInfo(list(token_bytes), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=self.eos_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # how many specs were compiled (tests: the cache is used)
        # xgrammar's JSON strings admit raw control bytes (< 0x20), which JSON forbids
        # unescaped (json.loads refuses them): JSON rows also AND this mask, which drops
        # every token holding one. Compact JSON never needs them outside strings, and a
        # string can always go on with an escape or end, so no row is left without a token.
        clean = torch.tensor([not any(b < 0x20 for b in tok) for tok in token_bytes]
                             + [False] * (vocab_size - len(token_bytes)))
        clean[self.eos_ids] = True
        self.json_clean = _pack_bits(clean)

    @classmethod
    def for_checkpoint(cls, model_path: str, vocab_size: int, eos_ids: Sequence[int]) -> "GrammarCache":
        from ..frontend.tokenizer import TextCodec  # the tokenizer only, no transformers
        codec = TextCodec(model_path)
        n = min(codec.vocab_size, vocab_size)
        toks = [b"" if codec.is_special(i) and i not in eos_ids else codec.token_bytes(i) for i in range(n)]
        return cls(toks, vocab_size, eos_ids)

    def compile(self, g: Grammar) -> xgr.CompiledGrammar:
        key = (g.kind, g.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            if g.kind == "json_object":  # any object; strict_mode off so any property may appear
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                             strict_mode=False)
            elif g.kind == "json_schema":
                compiled = self.compiler.compile_json_schema(g.spec, any_whitespace=False)
            elif g.kind == "regex":
                compiled = self.compiler.compile_regex(g.spec)
            elif g.kind == "ebnf":
                compiled = self.compiler.compile_grammar(g.spec)
            else:
                raise GrammarError(f"unknown grammar kind {g.kind!r}")
        except GrammarError:
            raise
        except Exception as e:
            raise GrammarError(f"cannot compile the {g.kind} grammar: {e}") from None
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, g: Grammar, generated: Sequence[int] = ()) -> "RowGrammar":
        """A fresh matcher for one row, advanced over the tokens it already generated."""
        rg = RowGrammar(xgr.GrammarMatcher(self.compile(g)), self.eos_ids,
                        self.json_clean if g.kind in ("json_object", "json_schema") else None)
        for i, tok in enumerate(generated):
            if not rg.matcher.accept_token(int(tok)):
                raise GrammarError(f"generated token {tok} (#{i}) does not fit the row's grammar")
        return rg


@dataclass
class RowGrammar:
    """One row's matcher."""
    matcher: xgr.GrammarMatcher
    eos_ids: list[int]
    also: Optional[torch.Tensor] = None  # a bitmask ANDed into every step's (JSON: no control bytes)

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Write this row's allowed-next-token bits into bitmask[index]."""
        if self.done:
            bitmask[index].zero_()
            for t in self.eos_ids:
                bitmask[index, t // 32] |= _bit(t % 32)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)
            if self.also is not None:
                bitmask[index] &= self.also

    def advance(self, token: int) -> None:
        """Feed the sampled token. The mask only allowed tokens the matcher accepts, so
        a refusal here means a bug; it is raised, not ignored."""
        if self.done:
            return
        if not self.matcher.accept_token(int(token)):
            raise GrammarError(f"sampled token {token} does not fit the grammar")


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def _pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool [vocab] -> int32 [ceil(vocab/32)] in xgrammar's layout."""
    words = (allowed.numel() + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:allowed.numel()] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def allocate(n: int, vocab_size: int) -> torch.Tensor:
    return xgr.allocate_token_bitmask(n, vocab_size)
