"""Tool calls in a model's reply: its text -> content and OpenAI `tool_calls`, whole or
as it streams.

Job: split what a model wrote into content and tool calls, in the format of its family:
- `hermes` (Qwen2/2.5/3, Hermes, and the fallback block this server writes for a
  template without tools): any number of
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, text around them;
- `llama3_json` (Llama 3.x): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`;
- `mistral_v3` / `mistral` (Mistral): text, then `[TOOL_CALLS]` followed by either a
  JSON list of `{"name": ..., "arguments": {...}}` (v3) or `name[ARGS]{...}` (newer,
  optionally `name[CALL_ID]id[ARGS]{...}`), repeated per call; both are read either way
  (tools/mistral.py).
The family is read from the chat template (`format_for_template`), Hermes by default.

Invariants:
- `ToolParser` is chunking-invariant: the events of a text fed in any split join to the
  events of the whole (`parse` is feed + finish), so a stream reassembles to the
  non-streamed reply. Text that may still turn into a call is held back until it is
  decided, never streamed and then taken back (as stop strings are held back).
- A call's JSON is found structurally (json_scan: brackets and strings) and decoded by
  json's decoder; a closing tag inside an argument string never ends a call.
- Only a well-formed call becomes a tool call: a JSON object whose `name` is one of the
  offered tools and whose arguments are an object. Anything else stays in the content
  verbatim. Whitespace touching a parsed call (the template's separators) is dropped.
- `arguments` is a JSON string, as OpenAI sends it: json.dumps of the parsed object, so a
  raw control character the grammar let into a string comes back escaped.
- `max_calls` (1 when `parallel_tool_calls` is false) bounds the calls returned; a
  forced call's grammar already allows only one, so only an `auto` reply can have more,
  and the later well-formed calls are dropped, not turned into content.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Optional, Union

from ferroxmp.frontend.tools.json_scan import JsonScan, decode
from ferroxmp.frontend.tools.mistral import ARGS, TOOL_CALLS, MistralParsing, held_prefix as _held_prefix

HERMES, LLAMA3_JSON, MISTRAL_V3, MISTRAL = "hermes", "llama3_json", "mistral_v3", "mistral"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def format_for_template(template: Optional[str]) -> str:
    """The tool-call format a chat template teaches its model."""
    t = template or ""
    if OPEN in t:
        return HERMES
    if TOOL_CALLS in t:
        return MISTRAL if ARGS in t else MISTRAL_V3
    if "<|eot_id|>" in t or "ipython" in t or PYTHON_TAG in t:
        return LLAMA3_JSON
    return HERMES


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Event = Union[str, ToolCall]


@dataclass
class ToolParser(MistralParsing):
    fmt: str
    names: frozenset
    max_calls: Optional[int] = None
    calls: int = 0  # calls returned so far
    _buf: str = ""  # text not yet decided
    _in_call: bool = False  # hermes: inside <tool_call> ... (OPEN consumed, body in _buf)
    _ws: str = ""  # hermes: whitespace seen just before the open tag
    _after_call: bool = False  # hermes: whitespace following a parsed call is dropped
    _plain: bool = False  # llama3_json/mistral: the rest of the reply is content
    _scan: Optional[JsonScan] = None  # the call's JSON being scanned

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        if self.fmt == LLAMA3_JSON:
            self._feed_llama(out)
        elif self.fmt in (MISTRAL, MISTRAL_V3):
            self._feed_mistral(out)
        else:
            self._feed_hermes(out)
        return _merge(out)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.fmt == LLAMA3_JSON:
            if not self._plain:
                body = self._buf.strip()
                body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
                call = self._call(body, ("parameters", "arguments"))
                if call is None:
                    out.append(self._buf)
                else:
                    self._emit_call(out, call)
            else:
                out.append(self._buf)
        elif self._in_call:  # an unclosed call (cut by max_tokens or a stop): content as written
            out.append(self._ws + (TOOL_CALLS if self.fmt in (MISTRAL, MISTRAL_V3) else OPEN) + self._buf)
        elif not self._after_call:
            out.append(self._buf)
        self._buf, self._ws, self._in_call, self._scan = "", "", False, None
        return _merge(out)

    # ---- hermes ----------------------------------------------------------------------

    def _feed_hermes(self, out: list[Event]) -> None:
        while True:
            if self._in_call:
                if not self._hermes_body(out):
                    return
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return
                self._after_call = False
            i = self._buf.find(OPEN)
            if i >= 0:
                before = self._buf[:i]
                head = before.rstrip()
                out.append(head)
                self._ws, self._buf, self._in_call = before[len(head):], self._buf[i + len(OPEN):], True
                continue
            keep = len(self._buf) - _held_prefix(self._buf, OPEN)
            head = self._buf[:keep].rstrip()  # trailing whitespace waits: a call may follow
            out.append(head)
            self._buf = self._buf[len(head):]
            return

    def _hermes_body(self, out: list[Event]) -> bool:
        """Decide the call whose body is in _buf (after OPEN); False: wait for more."""
        buf = self._buf
        k = len(buf) - len(buf.lstrip())
        if k == len(buf):
            return False
        frm = k  # not a JSON object: content up to the close tag
        if buf[k] == "{":
            self._scan = self._scan or JsonScan(k)
            kind, i = self._scan.advance(buf, CLOSE)
            if kind == "more":
                return False
            frm = i
            rest = buf[i:].lstrip()
            if kind == "end" and rest.startswith(CLOSE):
                call = self._call(buf[k:i], ("arguments",))
                if call is not None:
                    self._emit_call(out, call)
                    self._buf = rest[len(CLOSE):]
                    self._after_call, self._ws, self._in_call, self._scan = True, "", False, None
                    return True
            elif kind == "end" and CLOSE.startswith(rest):  # the close tag may be coming
                return False
        j = buf.find(CLOSE, frm)
        if j < 0:
            return False
        out.append(self._ws + OPEN + buf[:j + len(CLOSE)])
        self._buf = buf[j + len(CLOSE):]
        self._after_call, self._ws, self._in_call, self._scan = False, "", False, None
        return True

    # ---- llama 3 json ----------------------------------------------------------------

    def _feed_llama(self, out: list[Event]) -> None:
        if self._plain:
            out.append(self._buf)
            self._buf = ""
            return
        lead = self._buf.lstrip()
        if lead.startswith(PYTHON_TAG):
            lead = lead[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(lead):
            return  # empty, or possibly the tag itself: undecided
        if lead and not lead.startswith("{"):
            self._plain = True
            out.append(self._buf)
            self._buf = ""
        # otherwise a JSON object may be coming: held until the reply ends

    # ---- shared ----------------------------------------------------------------------

    def _call(self, body: str, keys: tuple) -> Optional[ToolCall]:
        try:
            obj = decode(body)
        except ValueError:
            return None
        return self._call_obj(obj, keys)

    def _call_obj(self, obj, keys: tuple) -> Optional[ToolCall]:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in self.names:
            return None
        args = next((obj[k] for k in keys if k in obj), {})
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def _emit_call(self, out: list[Event], call: ToolCall) -> None:
        if self.max_calls is None or self.calls < self.max_calls:
            self.calls += 1
            out.append(call)


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent texts joined, empty ones dropped."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, str):
            if not e:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += e
                continue
        out.append(e)
    return out


@dataclass
class Parsed:
    content: Optional[str]  # None when the reply is only calls
    calls: list[ToolCall]


def parse(text: str, fmt: str, names, max_calls: Optional[int] = None) -> Parsed:
    """The whole reply at once: the same events a stream of it gives."""
    p = ToolParser(fmt, frozenset(names), max_calls)
    events = p.feed(text) + p.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return Parsed(content or None, [e for e in events if isinstance(e, ToolCall)])
