"""Incremental detokenization and stop-string matching, O(new tokens) per step.

Detokenizer: decodes a growing token list without re-decoding it. It keeps two
offsets into the ids: text for ids[prefix:read] was already emitted; each step
decodes ids[prefix:] and emits what it adds beyond ids[prefix:read]. Decoding a
short window keeps the cost per step bounded, and decoding it *with* the
previous chunk keeps context-dependent pieces right (a leading-space marker, a
multi-byte character split over tokens). Invariants: text ending in U+FFFD (an
incomplete UTF-8 sequence) is held back until the next token completes it or
`finish` flushes it; the concatenation of everything emitted equals
`decode(all ids)` for tokenizers whose decode is a concatenation of pieces
(byte-level BPE, sentencepiece with byte fallback).

CharOffsets: where each token's text starts, in characters, for completions'
`text_offset`. Invariant: offsets index the text the detokenizer emits, also
after a token that holds only part of a character (it is placed at that
character) or an invalid byte (one U+FFFD per maximal invalid run, as decode
writes it).

StopMatcher: finds the earliest stop string in the text stream even when it
spans chunks, and holds back any tail that could still become a stop string so
a streamed client never sees text that is later trimmed.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

_INCOMPLETE = "\ufffd"


@dataclass
class Detokenizer:
    decode: Callable[[list[int]], str]
    ids: list[int] = field(default_factory=list)
    prefix: int = 0  # start of the window whose text was already emitted
    read: int = 0  # end of that window: ids[read:] are not yet emitted

    @classmethod
    def with_context(cls, decode: Callable[[list[int]], str], context: Sequence[int]) -> "Detokenizer":
        """Start after `context` (the prompt's tail), whose text is not emitted, so the
        first generated token decodes as it would mid-sentence."""
        ids = list(context)
        if decode(ids).endswith(_INCOMPLETE):  # a context cut mid-character would shift the text
            ids = []
        return cls(decode=decode, ids=ids, prefix=0, read=len(ids))

    def feed(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in new_ids)
        return self._step(final=False)

    def finish(self) -> str:
        """Flush held-back text (an incomplete character becomes U+FFFD, as in a full decode)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self.read >= len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if not final and (len(after) <= len(before) or after.endswith(_INCOMPLETE)):
            return ""
        # If the window re-decodes differently (rare cleanup rules), its tail is still
        # the best guess of the new text; byte-level and byte-fallback never differ.
        text = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return text

    def check_integrity(self) -> None:
        if not 0 <= self.prefix <= self.read <= len(self.ids):
            raise AssertionError(f"offsets out of order: prefix={self.prefix} read={self.read} ids={len(self.ids)}")


@dataclass
class CharOffsets:
    chars: int = 0  # characters the bytes fed so far decode to (an incomplete tail not counted)
    _utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def offset_of(self, piece: bytes) -> int:
        """The character index where a token with these bytes starts; feeds them."""
        if not piece:
            return self.chars
        out = self._utf8.decode(piece[:1])
        # With bytes still pending, the first byte belongs to the character being built
        # (which starts after `out`); otherwise it ended the last character of `out`.
        at = self.chars + len(out) - (0 if self._utf8.getstate()[0] else 1)
        self.chars += len(out) + len(self._utf8.decode(piece[1:]))
        return at


@dataclass
class StopMatcher:
    stops: list[str]
    held: str = ""  # text not yet released: it may be the start of a stop string
    stopped: bool = False
    matched: Optional[str] = None

    @property
    def _longest(self) -> int:
        return max((len(s) for s in self.stops), default=0)

    def feed(self, text: str) -> str:
        """Text safe to release now; sets `stopped` when a stop string appears (trimmed)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        keep = self._tail_that_may_start_a_stop(buf)
        hit = self._earliest_hit(buf)
        # A hit decides only if no longer stop could still start before it: with stops
        # "a" and "baa", the text "ba" holds a hit at 1, but "baa" may yet match at 0.
        if hit is not None and hit[0] <= len(buf) - keep:
            return self._stop(buf, hit)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def finish(self) -> str:
        out, self.held = self.held, ""
        if self.stopped:
            return ""
        hit = self._earliest_hit(out)  # the stream ended: a held hit now decides
        return self._stop(out, hit) if hit is not None else out

    def _earliest_hit(self, buf: str):
        return min(((buf.find(s), s) for s in self.stops if s in buf), default=None)

    def _stop(self, buf: str, hit) -> str:
        self.stopped, self.matched, self.held = True, hit[1], ""
        return buf[:hit[0]]

    def check_integrity(self) -> None:
        if self.held and not any(s.startswith(self.held) and len(self.held) < len(s) for s in self.stops):
            raise AssertionError(f"held {self.held!r}, which cannot start any stop string")

    def _tail_that_may_start_a_stop(self, buf: str) -> int:
        # A match can only start in the last (longest stop - 1) characters.
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[len(buf) - k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
