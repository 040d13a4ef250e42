"""OpenAI's Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}) as a thin dialect.

`to_chat` translates a Responses request (input string or items: messages,
function_call, function_call_output; instructions; function tools; text.format;
previous_response_id) into the chat-completions body; the shared code (dialect.py)
parses, renders and generates it; `ResponsesWriter` writes `output` items back, or the
typed event stream (response.created, .in_progress, .output_item.added,
.content_part.added, .output_text.delta/.done, .content_part.done,
.function_call_arguments.delta/.done, .output_item.done, .completed), every event
with its `sequence_number`.

Invariants: the output_text of a reply is the chat completion's content for the same
conversation; streamed events reassemble to the stored response; a stored response
(store: true, the default) keeps the conversation it ended, so previous_response_id
continues it exactly; the store is bounded (`STORE_LIMIT` responses, least recently
stored dropped first; a dropped or unknown id is a 404); anything not implemented is
a 400 naming it.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import msgspec

from ferroxmp.frontend.errors import ApiError, bad_param
from ferroxmp.frontend.fields import Fields, check_names
from ferroxmp.frontend.generation import Delta, Generation
from ferroxmp.frontend.tools.parse import ToolCall, ToolParser

_json = msgspec.json.Encoder()
STORE_LIMIT = 1024  # responses kept for GET and previous_response_id, per server process
FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                    "tool_choice", "parallel_tool_calls", "text", "stream", "store", "previous_response_id",
                    "metadata", "user"})
NOT_YET = {"truncation": "disabled", "include": [], "service_tier": "auto", "reasoning": {}}


@dataclass
class Stored:
    body: dict  # the response object as returned
    messages: list[dict]  # the chat conversation it ended (input + its output), for continuation


class ResponseStore:
    """Bounded, thread-safe: the HTTP server answers requests on several threads."""

    def __init__(self, limit: int = STORE_LIMIT):
        self.limit = limit
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, item: Stored) -> None:
        with self._lock:
            self._items[rid] = item
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, rid: str) -> Stored:
        with self._lock:
            item = self._items.get(rid)
        if item is None:
            raise ApiError(404, f"no response with id '{rid}' is stored here (unknown, deleted, or dropped: "
                           f"the store keeps the last {self.limit})", param="response_id", code="not_found")
        return item

    def delete(self, rid: str) -> None:
        with self._lock:
            if self._items.pop(rid, None) is None:
                raise ApiError(404, f"no response with id '{rid}' is stored here", param="response_id",
                               code="not_found")


def _parts(v: Any, param: str) -> str:
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad_param(param, "must be a string or a list of content parts")
    out = []
    for j, p in enumerate(v):
        pf = Fields(p, f"{param}[{j}].")
        kind = pf.raw("type")
        if kind not in ("input_text", "output_text", "text"):
            raise bad_param(pf.name("type"), f"content part {kind!r:.40} is not supported; only input_text "
                            "and output_text")
        check_names(pf.obj, frozenset({"type", "text", "annotations", "logprobs"}), {}, pf.prefix)
        out.append(pf.str("text", "", max_len=2 ** 31))
    return "".join(out)


def _items(raw: Any) -> list[dict]:
    """Responses input items -> chat messages. Consecutive assistant items (its text and
    its function_calls, which a reply's `output` lists as separate items) join one
    assistant message, as the model wrote them and as the store keeps them."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_param("input", "must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(raw):
        f = Fields(item, f"input[{i}].")
        kind = f.raw("type") or "message"
        if kind == "message":
            check_names(f.obj, frozenset({"type", "role", "content", "id", "status"}), {}, f.prefix)
            role = f.raw("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_param(f.name("role"), f"must be user, assistant, system or developer; got {role!r:.40}")
            text = _parts(f.raw("content"), f.name("content"))
            if role == "assistant" and out and out[-1]["role"] == "assistant":
                out[-1]["content"] = (out[-1]["content"] or "") + text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            check_names(f.obj, frozenset({"type", "call_id", "name", "arguments", "id", "status"}), {}, f.prefix)
            call = {"id": f.str("call_id", ""), "type": "function",
                    "function": {"name": f.str("name", ""), "arguments": f.str("arguments", "{}", max_len=2 ** 24)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            check_names(f.obj, frozenset({"type", "call_id", "output", "id", "status"}), {}, f.prefix)
            out.append({"role": "tool", "tool_call_id": f.str("call_id", ""),
                        "content": _parts(f.raw("output") or "", f.name("output"))})
        elif kind == "reasoning":
            continue  # earlier turns' reasoning is not shown to the template again
        else:
            raise bad_param(f.name("type"), f"input item {kind!r:.40} is not supported; send messages, "
                            "function_call or function_call_output")
    return out


def _tools(f: Fields, chat: dict) -> None:
    raw = f.raw("tools")
    if raw is not None:
        if not isinstance(raw, list):
            raise bad_param("tools", "must be a list of tools")
        tools = []
        for i, t in enumerate(raw):
            tf = Fields(t, f"tools[{i}].")
            if tf.raw("type") != "function":
                raise bad_param(tf.name("type"), f"tool type {tf.raw('type')!r:.40} is not supported; only "
                                "'function'")
            check_names(tf.obj, frozenset({"type", "name", "description", "parameters", "strict"}), {}, tf.prefix)
            fn = {k: tf.raw(k) for k in ("name", "description", "parameters", "strict") if tf.has(k)}
            tools.append({"type": "function", "function": fn})
        chat["tools"] = tools
    choice = f.raw("tool_choice")
    if isinstance(choice, dict):
        cf = Fields(choice, "tool_choice.")
        check_names(cf.obj, frozenset({"type", "name"}), {}, cf.prefix)
        if cf.raw("type") != "function":
            raise bad_param("tool_choice.type", "must be 'function' (or tool_choice a string)")
        chat["tool_choice"] = {"type": "function", "function": {"name": cf.str("name", "")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    if f.has("parallel_tool_calls"):
        chat["parallel_tool_calls"] = f.raw("parallel_tool_calls")


def _format(f: Fields, chat: dict) -> Optional[dict]:
    text = f.raw("text")
    if text is None:
        return None
    tf = Fields(text, "text.")
    check_names(tf.obj, frozenset({"format", "verbosity"}), {}, tf.prefix)
    fmt = tf.raw("format")
    if fmt is None:
        return None
    ff = Fields(fmt, "text.format.")
    kind = ff.raw("type")
    if kind == "text":
        return fmt
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        check_names(ff.obj, frozenset({"type", "name", "schema", "strict", "description"}), {}, ff.prefix)
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: ff.raw(k) for k in ("name", "schema", "strict", "description") if ff.has(k)}}
    else:
        raise bad_param("text.format.type", f"must be text, json_object or json_schema; got {kind!r:.40}")
    return fmt


def to_chat(body: Any, store: ResponseStore) -> tuple[dict, list[dict], dict]:
    """(chat body, the conversation's messages, what the response echoes back)."""
    f = Fields(body)
    check_names(f.obj, FIELDS, NOT_YET)
    messages: list[dict] = []
    prev = f.str("previous_response_id", max_len=256)
    if prev is not None:  # a previous response's instructions are not carried over (OpenAI's rule)
        messages = [dict(m) for m in store.get(prev).messages if not m.get("_instructions")]
    if f.has("instructions"):
        messages.insert(0, {"role": "system", "content": f.str("instructions", max_len=2 ** 24),
                            "_instructions": True})
    raw = f.raw("input")
    if raw is None:
        raise bad_param("input", "is required: a string or a list of items")
    messages += _items(raw)
    chat: dict = {"messages": [{k: v for k, v in m.items() if not k.startswith("_")} for m in messages]}
    _tools(f, chat)
    fmt = _format(f, chat)
    mt = f.int("max_output_tokens", None, 1, 2 ** 31)
    if mt is not None:
        chat["max_tokens"] = mt
    for key in ("temperature", "top_p", "stream", "model"):
        if f.has(key):
            chat[key] = f.raw(key)
    echo = {"instructions": f.raw("instructions"), "max_output_tokens": mt, "previous_response_id": prev,
            "temperature": f.raw("temperature") if f.has("temperature") else 1.0,
            "top_p": f.raw("top_p") if f.has("top_p") else 1.0, "tools": f.raw("tools") or [],
            "tool_choice": f.raw("tool_choice") or "auto",
            "parallel_tool_calls": f.bool("parallel_tool_calls", True),
            "text": {"format": fmt or {"type": "text"}}, "metadata": f.raw("metadata") or {},
            "store": f.bool("store", True), "user": f.raw("user")}
    return chat, messages, echo


@dataclass
class ResponsesWriter:
    model: str
    request_id: str
    tool_parser: Optional[Callable[[], ToolParser]]
    echo: dict
    messages: list[dict]  # the conversation so far, for the store
    store: ResponseStore
    created: int = field(default_factory=lambda: int(time.time()))
    output: list[dict] = field(default_factory=list)
    finish: Optional[str] = None
    seq: int = 0
    _parser: Optional[ToolParser] = None
    _open: bool = False  # a message item is open (the last of `output`)
    _thinking: Optional[dict] = None  # an open reasoning item (--reasoning-parser), the last of `output`

    @property
    def id(self) -> str:
        return "resp_" + self.request_id

    def sse(self, event: dict) -> bytes:
        event["sequence_number"] = self.seq
        self.seq += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + _json.encode(event) + b"\n\n"

    def response(self, gen: Generation, status: str) -> dict:
        c = gen.choices[0]
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model,
                "output": self.output if status != "in_progress" else [], **self.echo,
                "usage": None if status == "in_progress" else {
                    "input_tokens": c.prompt_tokens, "input_tokens_details": {"cached_tokens": c.cached_tokens},
                    "output_tokens": c.n_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": c.prompt_tokens + c.n_tokens}}

    def first(self, gen: Generation) -> list[dict]:
        r = self.response(gen, "in_progress")
        return [{"type": "response.created", "response": r}, {"type": "response.in_progress", "response": r}]

    def delta(self, d: Delta) -> list[dict]:
        if d.finish_reason is not None:
            self.finish = d.finish_reason
        if self.tool_parser is None:
            pieces: list = [d.text] if d.text else []
        else:
            if self._parser is None:
                self._parser = self.tool_parser()
            pieces = self._parser.feed(d.text) + (self._parser.finish() if d.finish_reason is not None else [])
        out: list[dict] = []
        if d.reasoning:
            out += self._reason(d.reasoning)
        for p in pieces:
            if isinstance(p, ToolCall):
                out += self._close()
                k = len(self.output)
                item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": p.id,
                        "name": p.name, "arguments": "", "status": "in_progress"}
                self.output.append(item)
                out.append({"type": "response.output_item.added", "output_index": k, "item": dict(item)})
                item["arguments"], item["status"] = p.arguments, "completed"
                out += [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                         "output_index": k, "delta": p.arguments},
                        {"type": "response.function_call_arguments.done", "item_id": item["id"],
                         "output_index": k, "arguments": p.arguments},
                        {"type": "response.output_item.done", "output_index": k, "item": dict(item)}]
            elif p:
                if not self._open:
                    out += self._close()
                    self._open = True
                    item = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "in_progress",
                            "role": "assistant", "content": []}
                    self.output.append(item)
                    k = len(self.output) - 1
                    out += [{"type": "response.output_item.added", "output_index": k,
                             "item": {**item, "content": []}},
                            {"type": "response.content_part.added", "item_id": item["id"], "output_index": k,
                             "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}]
                    item["content"].append({"type": "output_text", "text": "", "annotations": []})
                item = self.output[-1]
                item["content"][0]["text"] += p
                out.append({"type": "response.output_text.delta", "item_id": item["id"],
                            "output_index": len(self.output) - 1, "content_index": 0, "delta": p})
        return out

    def _reason(self, text: str) -> list[dict]:
        """The thinking, as a reasoning item before the answer's items."""
        out: list[dict] = []
        if self._thinking is None:
            out += self._close()
            self._thinking = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [],
                              "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            self.output.append(self._thinking)
            out.append({"type": "response.output_item.added", "output_index": len(self.output) - 1,
                        "item": {**self._thinking, "content": []}})
        self._thinking["content"][0]["text"] += text
        out.append({"type": "response.reasoning_text.delta", "item_id": self._thinking["id"],
                    "output_index": len(self.output) - 1, "content_index": 0, "delta": text})
        return out

    def _close(self) -> list[dict]:
        if self._thinking is not None:
            item, self._thinking = self._thinking, None
            item["status"] = "completed"
            k = self.output.index(item)
            return [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": k,
                     "content_index": 0, "text": item["content"][0]["text"]},
                    {"type": "response.output_item.done", "output_index": k, "item": item}]
        if not self._open:
            return []
        self._open = False
        k = len(self.output) - 1
        item = self.output[k]
        item["status"] = "completed"
        part = item["content"][0]
        return [{"type": "response.output_text.done", "item_id": item["id"], "output_index": k,
                 "content_index": 0, "text": part["text"]},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": k,
                 "content_index": 0, "part": part},
                {"type": "response.output_item.done", "output_index": k, "item": item}]

    def _finish(self, gen: Generation) -> dict:
        events = self._close()
        status = "incomplete" if self.finish == "length" else "completed"
        body = self.response(gen, status)
        if self.echo["store"]:
            self.store.put(self.id, Stored(body, self.messages + [self._as_message()]))
        self._done_events = events
        return body

    def _as_message(self) -> dict:
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        msg: dict = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        return msg

    def end(self, gen: Generation) -> list[dict]:
        # response.completed even when cut by max_output_tokens (status "incomplete" inside):
        # the openai SDK's stream helper waits for that event and fails on any other.
        body = self._finish(gen)
        return self._done_events + [{"type": "response.completed", "response": body}]

    def body(self, gen: Generation) -> dict:
        return self._finish(gen)


def error_event(e: ApiError) -> dict:
    return {"type": "error", "code": e.code, "message": e.message, "param": e.param}


def deleted(rid: str) -> dict:
    return {"id": rid, "object": "response", "deleted": True}

