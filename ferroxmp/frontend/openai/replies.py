"""Responses: Generation deltas -> OpenAI (and native /generate) JSON shapes.

One Formatter per endpoint kind builds the streamed chunk for a delta and, from
the accumulated choices, the whole non-streamed body. Invariants: a streamed
response's text concatenated per choice equals the non-streamed text for the
same deltas; `usage` is the same dict in both; a chat stream opens each choice
with `{"role": "assistant", "content": ""}`; logprob token strings come from the
token's bytes, never from a re-tokenization. With tool parsing (`tool_parser`), each
choice's text goes through its own tools.ToolParser in both shapes, so streamed content
and `tool_calls` deltas reassemble to the non-streamed message; finish_reason "stop"
becomes "tool_calls" when the choice made a call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import msgspec

from ferroxmp.frontend.text.detokenizer import CharOffsets
from ferroxmp.frontend.generation import Delta, TokenInfo
from ferroxmp.frontend.text.tokenizer import TextCodec
from ferroxmp.frontend.tools.parse import ToolCall, ToolParser
from ferroxmp.protocol import Logprobs

_json = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class ChoiceText:
    text: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_logprobs: list[Logprobs] = field(default_factory=list)  # prompt positions 1..
    reasoning: list[str] = field(default_factory=list)  # --reasoning-parser: the thinking, apart


@dataclass
class Formatter:
    kind: str  # "completion" | "chat" | "generate"
    request_id: str
    model: str
    codec: TextCodec
    top_logprobs: Optional[int] = None  # None: the request asked for no logprobs
    echo_texts: list[str] = field(default_factory=list)  # per prompt, when echo
    echo_ids: list[list[int]] = field(default_factory=list)
    n: int = 1
    tool_parser: Optional[Callable[[], ToolParser]] = None  # chat with tools: a fresh parser per choice
    created: int = field(default_factory=lambda: int(time.time()))
    acc: dict[int, ChoiceText] = field(default_factory=dict)
    _opened: set = field(default_factory=set)
    _offsets: dict[int, CharOffsets] = field(default_factory=dict)  # per choice, across chunks
    _parsers: dict[int, ToolParser] = field(default_factory=dict)  # per streamed choice

    @property
    def response_id(self) -> str:
        return {"completion": "cmpl-", "chat": "chatcmpl-"}.get(self.kind, "") + self.request_id

    def add(self, d: Delta) -> None:
        c = self.acc.setdefault(d.index, ChoiceText())
        c.text.append(d.text)
        c.reasoning.append(d.reasoning)
        c.tokens.extend(d.tokens)
        c.prompt_logprobs.extend(d.prompt_logprobs)
        c.finish_reason = d.finish_reason or c.finish_reason

    # ---- logprobs --------------------------------------------------------------------

    def _completion_logprobs(self, index: int, tokens: list[TokenInfo], first: bool,
                             prompt_lps: list[Logprobs]) -> Optional[dict]:
        if self.top_logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        base = 0
        if self.echo_texts:
            base = len(self.echo_texts[index // self.n])
            if first:  # prompt tokens: the first has no logprob (nothing precedes it)
                prompt_offsets = CharOffsets()
                for k, t in enumerate(self.echo_ids[index // self.n]):
                    lp = prompt_lps[k - 1] if 0 < k <= len(prompt_lps) else None
                    out["tokens"].append(self.codec.token_text(t))
                    out["token_logprobs"].append(lp.token_logprob if lp else None)
                    out["top_logprobs"].append(self._top(lp))
                    out["text_offset"].append(prompt_offsets.offset_of(self._text_bytes(t)))
        offsets = self._offsets.setdefault(index, CharOffsets())
        for t in tokens:
            lp = t.logprobs
            out["tokens"].append(self.codec.token_text(t.token_id))
            out["token_logprobs"].append(lp.token_logprob if lp else None)
            out["top_logprobs"].append(self._top(lp))
            out["text_offset"].append(base + offsets.offset_of(self._text_bytes(t.token_id)))
        return out

    def _top(self, lp: Optional[Logprobs]) -> Optional[dict]:
        return {self.codec.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)} if lp else None

    def _text_bytes(self, token_id: int) -> bytes:
        # Special tokens are skipped when the text is decoded: they take no characters.
        return b"" if self.codec.is_special(token_id) else self.codec.token_bytes(token_id)

    def _entry(self, token_id: int, logprob: Optional[float]) -> dict:
        raw = self.codec.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def _chat_logprobs(self, tokens: list[TokenInfo]) -> Optional[dict]:
        if self.top_logprobs is None:
            return None
        content = []
        for t in tokens:
            lp = t.logprobs
            e = self._entry(t.token_id, lp.token_logprob if lp else None)
            e["top_logprobs"] = [self._entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)] if lp else []
            content.append(e)
        return {"content": content}

    # ---- streamed chunks -------------------------------------------------------------

    def is_empty(self, d: Delta) -> bool:
        """A delta whose text is still held back carries nothing a text client can use."""
        return (self.kind != "generate" and not d.text and not d.reasoning and d.finish_reason is None
                and self.top_logprobs is None)

    def chunks(self, d: Delta, include_usage: bool) -> list[dict]:
        """The SSE chunks for one delta: none while its text is held back."""
        if self.kind != "chat" or self.tool_parser is None:
            return [] if self.is_empty(d) else [self.chunk(d, include_usage)]
        p = self._parsers.get(d.index)
        if p is None:
            p = self._parsers[d.index] = self.tool_parser()
        events = p.feed(d.text) + (p.finish() if d.finish_reason is not None else [])
        first = d.index not in self._opened
        self._opened.add(d.index)
        lps = self._chat_logprobs(d.tokens) if d.tokens else None
        deltas: list[dict] = []
        if first or lps is not None:  # the role opens the choice; logprobs ride on a content delta
            deltas.append({"role": "assistant", "content": ""} if first else {"content": ""})
        if d.reasoning:  # the thinking goes first and is never parsed for tool calls
            deltas.append({"reasoning_content": d.reasoning})
        k = p.calls - sum(isinstance(e, ToolCall) for e in events)  # the index of this delta's first call
        for e in events:
            if isinstance(e, ToolCall):  # OpenAI's shape: id and name first, then the arguments
                deltas.append({"tool_calls": [{"index": k, "id": e.id, "type": "function",
                                               "function": {"name": e.name, "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": e.arguments}}]})
                k += 1
            elif deltas and set(deltas[-1]) <= {"role", "content"}:
                deltas[-1]["content"] += e
            else:
                deltas.append({"content": e})
        out = [self._chat_chunk(d.index, delta, lps if j == 0 else None, None, include_usage)
               for j, delta in enumerate(deltas)]
        if d.finish_reason is not None:
            reason = "tool_calls" if d.finish_reason == "stop" and p.calls else d.finish_reason
            out.append(self._chat_chunk(d.index, {}, None, reason, include_usage))
        return out

    def _chat_chunk(self, index: int, delta: dict, logprobs: Optional[dict], reason: Optional[str],
                    include_usage: bool) -> dict:
        body = {"id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": reason}]}
        if include_usage:
            body["usage"] = None
        return body

    def chunk(self, d: Delta, include_usage: bool) -> dict:
        first = d.index not in self._opened
        self._opened.add(d.index)
        if self.kind == "generate":
            out = {"output_ids": [t.token_id for t in d.tokens], "finish_reason": d.finish_reason}
            if self.top_logprobs is not None:
                out["logprobs"] = [_native_lp(t) for t in d.tokens]
            return out
        if self.kind == "chat":
            delta = {"role": "assistant", "content": d.text} if first else {"content": d.text}
            if d.finish_reason is not None and not d.text and not first:
                delta = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            choice = {"index": d.index, "delta": delta, "logprobs": self._chat_logprobs(d.tokens),
                      "finish_reason": d.finish_reason}
            obj = "chat.completion.chunk"
        else:
            text = d.text
            if first and self.echo_texts:
                text = self.echo_texts[d.index // self.n] + text
            choice = {"index": d.index, "text": text,
                      "logprobs": self._completion_logprobs(d.index, d.tokens, first, d.prompt_logprobs),
                      "finish_reason": d.finish_reason}
            obj = "text_completion"
        body = {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": usage}

    # ---- whole responses -------------------------------------------------------------

    def body(self, usage: dict) -> dict:
        indices = sorted(self.acc)
        if self.kind == "generate":
            c = self.acc.get(0, ChoiceText())
            out = {"output_ids": [t.token_id for t in c.tokens], "finish_reason": c.finish_reason,
                   "prompt_tokens": usage["prompt_tokens"],
                   "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}
            if self.top_logprobs is not None:
                out["logprobs"] = [_native_lp(t) for t in c.tokens]
            return out
        choices = []
        for i in indices:
            c = self.acc[i]
            text = "".join(c.text)
            if self.kind == "chat":
                message, reason = self._message(text, c.finish_reason)
                if any(c.reasoning):
                    message["reasoning_content"] = "".join(c.reasoning)
                choices.append({"index": i, "message": message, "logprobs": self._chat_logprobs(c.tokens),
                                "finish_reason": reason})
            else:
                if self.echo_texts:
                    text = self.echo_texts[i // self.n] + text
                choices.append({"index": i, "text": text, "logprobs": self._completion_logprobs(i, c.tokens, True, c.prompt_logprobs),
                                "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}


    def _message(self, text: str, reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """A whole reply's message: its text parsed into content and tool calls."""
        if self.tool_parser is None:
            return {"role": "assistant", "content": text}, reason
        p = self.tool_parser()
        events = p.feed(text) + p.finish()
        calls = [e.as_openai() for e in events if isinstance(e, ToolCall)]
        message = {"role": "assistant", "content": "".join(e for e in events if isinstance(e, str)) or None}
        if calls:
            message["tool_calls"] = calls
        return message, ("tool_calls" if calls and reason == "stop" else reason)


def _native_lp(t: TokenInfo) -> Optional[dict]:
    lp = t.logprobs
    if lp is None:
        return None
    return {"logprob": lp.token_logprob, "top_ids": lp.top_ids, "top_logprobs": lp.top_logprobs}
