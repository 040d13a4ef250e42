"""Mistral's tool calls in a reply, for tools.ToolParser (a mixin over its state: _buf,
_ws, _in_call, _after_call, _plain, _scan; _call, _call_obj, _emit_call).

Job: after content, `[TOOL_CALLS]` opens calls in either form, both read whatever the
template: v3 `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (a JSON list, or
one object), and the newer `[TOOL_CALLS]name[ARGS]{...}` (optionally
`name[CALL_ID]id[ARGS]{...}`), repeated per call.

Invariants: the JSON is found structurally (json_scan) and decoded by json, so a tag
inside an argument string is content of the string; text that may still become a tag
is held back; a `[TOOL_CALLS]` not followed by well-formed calls of offered tools turns
the rest of the reply into content verbatim (Mistral calls end the reply); decisions
depend only on the text seen, so any split of a stream gives the same events.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from ferroxmp.frontend.tools.json_scan import JsonScan, decode

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAMED = re.compile(r"([A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]{1,64})?\[ARGS\]")
_NAMED_CHARS = re.compile(r"[A-Za-z0-9_\-\[\]]*")
_NAMED_MAX = 160  # longer than any name[CALL_ID]id[ARGS]: past it, not that form


def held_prefix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for k in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0


class MistralParsing:
    def _feed_mistral(self, out: list) -> None:
        while not self._plain:
            if self._in_call:
                if not self._mistral_call(out):
                    return
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return
                self._after_call = False
            i = self._buf.find(TOOL_CALLS)
            if i < 0:
                keep = len(self._buf) - held_prefix(self._buf, TOOL_CALLS)
                head = self._buf[:keep].rstrip()
                out.append(head)
                self._buf = self._buf[len(head):]
                return
            head = self._buf[:i].rstrip()
            out.append(head)
            self._ws, self._buf, self._in_call = self._buf[len(head):i], self._buf[i + len(TOOL_CALLS):], True
        out.append(self._buf)
        self._buf = ""

    def _mistral_call(self, out: list) -> bool:
        """Decide what follows [TOOL_CALLS] in _buf; False: wait for more. Anything not a
        well-formed call turns the rest of the reply into content."""
        buf = self._buf
        k = len(buf) - len(buf.lstrip())
        if k == len(buf):
            return False
        calls: Optional[list] = None
        if buf[k] in "[{":  # v3: a list of calls (or one call object)
            self._scan = self._scan or JsonScan(k)
            kind, end = self._scan.advance(buf)
            if kind == "more":
                return False
            try:
                value = decode(buf[k:end])
            except ValueError:
                value = None
            items = value if isinstance(value, list) else [value]
            calls = [self._call_obj(v, ("arguments",)) for v in items]
        else:  # name[ARGS]{...}
            m = _NAMED.match(buf, k)
            if m is None:
                if len(buf) - k < _NAMED_MAX and _NAMED_CHARS.fullmatch(buf, k):
                    return False
            elif m.end() < len(buf) and buf[m.end()] == "{":
                self._scan = self._scan or JsonScan(m.end())
                kind, end = self._scan.advance(buf)
                if kind == "more":
                    return False
                calls = [self._call(f'{{"name": {json.dumps(m.group(1))}, "arguments": {buf[m.end():end]}}}',
                                    ("arguments",))]
            elif m.end() == len(buf):
                return False
        if not calls or any(c is None for c in calls):
            self._plain = True
            self._buf = self._ws + TOOL_CALLS + buf
            self._ws, self._in_call, self._scan = "", False, None
            return True
        for c in calls:
            self._emit_call(out, c)
        self._buf = buf[end:]
        self._after_call, self._ws, self._in_call, self._scan = True, "", False, None
        return True
