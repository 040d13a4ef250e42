"""PromptEncoder: a prompt's size is checked before it is tokenized, and tokenizing
never holds the interpreter.

Job: text -> token ids for the HTTP handlers, refusing unread any text whose length
alone proves it is longer than the context.

Why: `tokenizers`' `encode` holds the GIL for the whole call (a 3 MB prompt: ~7 s
in which no other client's stream moves), while `encode_batch` runs in Rust with
the GIL released; both give the same ids. And a prompt of B bytes has at least
ceil(B / (longest token in bytes x normalizer shrink)) tokens, so a text that
long is refused without being tokenized at all.

A `chat_template_kwargs` name the chat template never reads is refused, not ignored.

Invariants: `encode` equals the codec's own `encode`; `min_tokens` never exceeds
the real count (it is None where no safe bound is known: a normalizer that can
delete text, an unknown-token model that can swallow a run of characters).
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

import jinja2.meta
from tokenizers import Tokenizer

from ferroxmp.fits import context_refusal
from ferroxmp.frontend.errors import bad_param

# How many bytes of input a normalizer may turn into one byte (None: unbounded). Unicode
# normalization and case folding shrink by at most 3 (Hangul jamo -> syllable, KELVIN
# SIGN -> k); 4 leaves room. Prepend and a growing Replace only add bytes.
_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
# Long texts are tokenized on at most half the cores at once, so the worker, the scheduler
# and the streams keep the rest however many clients send long prompts together.
LONG_TEXT_CHARS = 1 << 16
_long_texts = threading.BoundedSemaphore(max(1, (os.cpu_count() or 2) // 2))


def _shrink(norm: Optional[dict]) -> Optional[int]:
    if norm is None:
        return 1
    kind = norm.get("type")
    if kind == "Sequence":
        factors = [_shrink(n) for n in norm.get("normalizers") or []]
        return None if None in factors else math.prod(factors)
    if kind == "Replace":
        pattern, content = norm.get("pattern") or {}, norm.get("content")
        if "String" in pattern and isinstance(content, str):
            return 1 if len(content.encode()) >= len(pattern["String"].encode()) else None
        return None
    return _SHRINK.get(kind)


def _unk_bytes(model: dict) -> Optional[int]:
    """Most input bytes one unknown token can stand for (0: no unknown token)."""
    if model.get("type") != "BPE":
        return None  # WordPiece/Unigram map a whole word to [UNK]
    if model.get("unk_token") is None or model.get("byte_fallback"):
        return 0
    return None if model.get("fuse_unk") else 4  # one character


@dataclass
class PromptEncoder:
    codec: Any  # TextCodec: encode(text, add_special_tokens), render_chat, token_bytes, vocab_size
    max_model_len: int
    bytes_per_token: Optional[int] = None  # None: no safe bound; every prompt is tokenized
    template_vars: Optional[frozenset] = None  # names the chat template reads; None: unknown

    @classmethod
    def for_codec(cls, codec: Any, max_model_len: int) -> "PromptEncoder":
        enc = cls(codec, max_model_len)
        tok = enc._tok
        if tok is not None:
            spec = json.loads(tok.to_str())
            shrink, unk = _shrink(spec.get("normalizer")), _unk_bytes(spec.get("model") or {})
            if shrink is not None and unk is not None:
                longest = max([len(codec.token_bytes(i)) for i in range(codec.vocab_size)] + [unk, 1])
                enc.bytes_per_token = longest * shrink
        enc.template_vars = _template_vars(codec)
        return enc

    @property
    def _tok(self) -> Optional[Tokenizer]:
        tok = getattr(self.codec, "tok", None)
        return tok if isinstance(tok, Tokenizer) else None

    def min_tokens(self, text: str) -> int:
        """A lower bound of the token count (0 when none is known)."""
        if self.bytes_per_token is None:
            return 0
        return -(-len(text.encode("utf-8")) // self.bytes_per_token)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, or a 400 naming `param` when it cannot fit the context."""
        bpt = self.bytes_per_token
        # UTF-8 takes 1 to 4 bytes a character: most texts are decided without copying them
        if bpt is not None and len(text) * 4 >= self.max_model_len * bpt:
            least = -(-len(text) // bpt)
            if least < self.max_model_len:
                least = self.min_tokens(text)
            if (why := context_refusal(least, None, self.max_model_len, at_least=True)) is not None:
                raise bad_param(param, why)
        tok = self._tok
        if tok is None:
            return self.codec.encode(text, add_special_tokens=add_special_tokens)
        if len(text) < LONG_TEXT_CHARS:
            return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids  # GIL released
        with _long_texts:
            return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def reads_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (unknown: assume it does)."""
        return self.template_vars is None or "tools" in self.template_vars

    def encode_chat(self, messages: list[dict], extra: dict, tools: Optional[list] = None) -> list[int]:
        """As TextCodec.encode_chat: the template writes every special token it wants.
        `tools` goes to the template's `tools` variable (tools/render.py decides it)."""
        for name in extra:
            if self.template_vars is not None and name != "add_generation_prompt" and name not in self.template_vars:
                raise bad_param(f"chat_template_kwargs.{name}", f"this model's chat template does not use "
                                f"'{name:.64}'; it would be ignored")
        text = self.codec.render_chat(messages, tools=tools, **extra)
        return self.encode(text, "messages", add_special_tokens=False)


def _template_vars(codec: Any) -> Optional[frozenset]:
    """The variables the chat template reads from its caller (jinja2.meta), parsed with
    the codec's own environment (its extensions and filters)."""
    source = getattr(codec, "chat_template", None)
    if not source:
        return frozenset()
    try:
        env = codec._template.environment
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except Exception:  # an unparsable template refuses every chat request anyway
        logging.getLogger("ferroxmp.frontend").warning("chat template not analysed: any chat_template_kwargs pass")
        return None
