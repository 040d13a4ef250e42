"""A byte-level llguidance matcher for grammar unit tests: every byte is a token (id =
its value) and 256 is EOS, so a string is accepted exactly when the grammar admits it."""
from __future__ import annotations

import llguidance

EOS = 256


class _Bytes:
    eos_token_id = EOS
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b""]
    special_token_ids = [EOS]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


_TOKENIZER = None


def tokenizer() -> llguidance.LLTokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=EOS + 1, eos_token=EOS)
    return _TOKENIZER


def matcher(kind: str, spec: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(tokenizer(), llguidance.grammar_from(kind, spec), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(kind: str, spec: str, text: str) -> bool:
    """Whether the grammar admits exactly `text` (then EOS)."""
    m = matcher(kind, spec)
    return all(m.consume_token(b) for b in text.encode()) and m.consume_token(EOS)


_CLOSING = frozenset([EOS] + list(b'"}]'))


def sample(kind: str, spec: str, rng, max_bytes: int = 4000) -> bytes:
    """A random text the grammar admits: each byte drawn among those the mask allows
    (closing ones favoured, so values end), until EOS. Raises if none comes in max_bytes."""
    m = matcher(kind, spec)
    out = bytearray()
    for _ in range(max_bytes):
        mask = int.from_bytes(m.compute_bitmask(), "little")
        allowed = [t for t in range(EOS + 1) if mask >> t & 1]
        assert allowed, m.get_error()
        closing = [t for t in allowed if t in _CLOSING]
        t = rng.choice(closing if closing and rng.random() < 0.5 else allowed)
        assert m.consume_token(t), m.get_error()
        if t == EOS:
            return bytes(out)
        out.append(t)
    raise AssertionError(f"no EOS within {max_bytes} bytes: {bytes(out[:200])!r}")
