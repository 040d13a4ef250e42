"""TextCodec: a checkpoint's tokenizer and chat template, without transformers.

From a GGUF file, both come from its metadata (ferroxmp/checkpoint/gguf_tokenizer.py).
From a folder: loads `tokenizer.json` with `tokenizers`, special tokens from
`tokenizer_config.json` (or `special_tokens_map.json`), and the chat template
from `chat_template.jinja` (which wins, as in transformers) or the config's
`chat_template`. The template renders in jinja2's ImmutableSandboxedEnvironment
with the globals transformers' apply_chat_template gives it, so a template
from the Hub is untrusted code that cannot reach Python internals.

Invariants: `render_chat` equals transformers' `apply_chat_template(...,
tokenize=False)`; `encode_chat` never adds special tokens of its own (the
template already wrote the BOS it wants, so none is added twice); `token_bytes`
gives a token's exact bytes (a byte-level BPE token may hold half a character).
"""
from __future__ import annotations

import json
import os
import re
from datetime import datetime
from functools import cached_property
from typing import Any, Optional

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ferroxmp.checkpoint import is_gguf
from ferroxmp.config import read_json as _read_json

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: printable Latin-1
    bytes as themselves, the rest shifted past U+0100 in byte order."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    alphabet, shifted = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(0x100 + shifted)] = b
            shifted += 1
    return alphabet


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    serving only needs the text, so the tag renders its body."""
    tags = {"generation"}

    def parse(self, parser):  # type: ignore[override]
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)



def _token_str(v: Any) -> Optional[str]:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _gguf_text(path: str) -> tuple:
    """Tokenizer (as its JSON: it may cross a pipe), special tokens and chat template from a
    GGUF file's metadata."""
    from ferroxmp.checkpoint import gguf_tokenizer
    from ferroxmp.checkpoint.gguf_file import open_gguf
    g = open_gguf(path)
    return gguf_tokenizer.build_tokenizer(g).to_str(), gguf_tokenizer.special_tokens(g), gguf_tokenizer.chat_template(g)


class TextCodec:
    def __init__(self, model_path: str, gguf_in_child: bool = False):
        """gguf_in_child: read a GGUF file's tokenizer in a forked child (forked.in_child),
        for a process that must not keep numpy and gguf resident (the frontend: ~12 MB);
        only before the process has threads."""
        if is_gguf(model_path):
            from ferroxmp.forked import in_child
            read = in_child(_gguf_text, model_path) if gguf_in_child else _gguf_text(model_path)
            tok_json, self.special_tokens, self.chat_template = read
            self.tok = Tokenizer.from_str(tok_json)
        else:
            self._init_folder(model_path)
        # The decoder's own JSON, not the whole tokenizer's (to_str() of a 49k vocabulary
        # parsed into Python objects left ~10 MB resident in every process that loads it).
        decoder = self.tok.decoder
        self._byte_level = decoder is not None and b"ByteLevel" in decoder.__getstate__()
        self._special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    def _init_folder(self, model_dir: str) -> None:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json; the frontend needs a fast tokenizer")
        self.tok = Tokenizer.from_file(path)
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        specials = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
        self.special_tokens: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            value = _token_str(config.get(name)) or _token_str(specials.get(name))
            if value is not None:
                self.special_tokens[name] = value
        self.chat_template = self._load_template(model_dir, config)

    @staticmethod
    def _load_template(model_dir: str, config: dict) -> Optional[str]:
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        t = config.get("chat_template")
        if isinstance(t, list):  # named templates: serve the default one
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            t = named.get("default")
        return t if isinstance(t, str) else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template or "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text; raises jinja2.TemplateError for a conversation the template refuses."""
        if self.chat_template is None:
            raise jinja2.exceptions.TemplateError("this model has no chat template; use /v1/completions")
        kwargs = {**self.special_tokens, **extra}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=kwargs.pop("tools", None), documents=kwargs.pop("documents", None),
                                     **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra), add_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @cached_property
    def _alphabet(self) -> dict[str, int]:
        return _byte_level_alphabet()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to the text (specials: their literal text)."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            alphabet = self._alphabet
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode("utf-8")
        m = _BYTE_TOKEN.match(piece)
        if m:  # sentencepiece byte fallback
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")
