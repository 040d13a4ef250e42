"""Where one JSON object or array ends in text that is still arriving.

Job: `JsonScan(start).advance(text, stop)` reads text[start:] (an object or array
opening at `start`) as far as it has arrived and says ("end", i): the value is
text[start:i]; ("more", -1): not complete yet; ("stop", i): `stop` (a closing tag)
occurs at i outside any string, so the value is malformed. The tool-call parsers use it
to find a call's JSON structurally, then decode it with json's own decoder
(`decode`): a closing tag inside an argument string is string content, never the end.

Invariants: the state is kept between calls, so a text fed in any split gives the same
answer as the whole (the scan never decides on a partial `stop`); after "end" or
"stop" the same answer is returned again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class JsonScan:
    start: int
    pos: int = -1  # next index to read (-1: start)
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    result: Optional[tuple[str, int]] = None

    def advance(self, text: str, stop: str = "") -> tuple[str, int]:
        if self.result is not None:
            return self.result
        i = self.start if self.pos < 0 else self.pos
        n = len(text)
        while i < n:
            c = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.result = ("end", i + 1)
                    return self.result
            elif stop and c == stop[0]:
                if text.startswith(stop, i):
                    self.result = ("stop", i)
                    return self.result
                if stop.startswith(text[i:]):  # a partial tag at the end: decide when it completes
                    self.pos = i
                    return ("more", -1)
            i += 1
        self.pos = i
        return ("more", -1)


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def decode(text: str) -> Any:
    """The JSON value of `text` (ValueError if it is not exactly one). strict=False:
    raw control characters in strings are read; NaN and Infinity are not JSON."""
    return json.loads(text, strict=False, parse_constant=_not_json)
