"""Typed, bounded reads from a client's JSON, and the JSON itself.

Job: turn untrusted JSON into Python values or an ApiError(400) naming the field.

Invariants:
- `decode_body` never lets a body reach a handler nested deeper than MAX_DEPTH
  (deep nesting would recurse in msgspec, jinja or json.dumps: a RecursionError is
  a 500, not an answer).
- Every number is typed (JSON booleans are not numbers, Python's bool is an int)
  and compared with its bounds before any conversion, so a 400-digit integer in a
  float field is a 400 (float() of it would overflow), and a bound the client
  exceeds is named in the message.
- `check_names` refuses every field a handler does not read: unknown ones, and
  known ones this server does not implement yet, unless their value is the one
  that asks for nothing (null, or the documented default). Nothing is accepted and
  then ignored.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import msgspec

from ferroxmp.frontend.errors import ApiError, bad_param

MAX_DEPTH = 64  # objects/arrays inside each other; tool schemas stay far below it
_decoder = msgspec.json.Decoder()


def decode_body(data: bytes) -> Any:
    """The JSON body, or a 400. The bracket count is a C-speed proof that a body is
    shallow; only a body with more brackets than MAX_DEPTH is walked."""
    try:
        obj = _decoder.decode(data)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as e:  # ValidationError too: e.g. 1e400, an integer past 2^64
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH:
        _check_depth(obj)
    return obj


def _too_deep() -> ApiError:
    return ApiError(400, f"the body is nested more than {MAX_DEPTH} levels deep", code="too_deep")


def _check_depth(obj: Any) -> None:
    todo = [(obj, 1)]
    while todo:
        node, depth = todo.pop()
        kids = node.values() if isinstance(node, dict) else node
        if depth > MAX_DEPTH:
            raise _too_deep()
        types = set(map(type, kids))  # map and set run in C: a long list of numbers costs little
        if list in types or dict in types:
            todo.extend((k, depth + 1) for k in kids if isinstance(k, (list, dict)))


def check_names(obj: dict, accepted: frozenset, not_yet: dict, prefix: str = "") -> None:
    """400 for the first field that is neither accepted nor a not-yet-implemented one
    holding its do-nothing value (`not_yet[name]`)."""
    for name, value in obj.items():
        if name in accepted or value is None:
            continue
        param = prefix + name
        if name in not_yet:
            if value == not_yet[name] and type(value) is type(not_yet[name]):
                continue
            raise ApiError(400, f"'{param}' is not supported by this server yet; remove it",
                           param=param, code="unsupported_parameter")
        raise ApiError(400, f"unknown field '{param}': this server does not implement it; remove it",
                       param=param, code="unknown_parameter")


class Fields:
    """Typed reads from one JSON object; errors name `prefix + key`."""

    def __init__(self, obj: Any, prefix: str = ""):
        if not isinstance(obj, dict):
            raise bad_param(prefix.rstrip(".") or "body", "must be a JSON object")
        self.obj, self.prefix = obj, prefix

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.obj.get(key)

    def name(self, key: str) -> str:
        return self.prefix + key

    def bool(self, key: str, default: bool = False) -> bool:
        v = self.obj.get(key)
        if v is None:
            return default
        if type(v) is not bool:
            raise bad_param(self.name(key), f"must be a boolean, got {_show(v)}")
        return v

    def str(self, key: str, default: Optional[str] = None, max_len: int = 256) -> Optional[str]:
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad_param(self.name(key), f"must be a string, got {_show(v)}")
        if len(v) > max_len:
            raise bad_param(self.name(key), f"at most {max_len} characters, got {len(v)}")
        return v

    def int(self, key: str, default: Optional[int], lo: int, hi: int, hi_is: str = "") -> Optional[int]:
        """An integer in [lo, hi]; `hi_is` names what the upper bound is."""
        v = self.obj.get(key)
        if v is None:
            return default
        if type(v) is float and v.is_integer():
            v = int(v)
        if type(v) is not int:
            raise bad_param(self.name(key), f"must be an integer, got {_show(v)}")
        if not lo <= v <= hi:
            top = f"{hi} ({hi_is})" if hi_is else f"{hi}"
            raise bad_param(self.name(key), f"must be in [{lo}, {top}], got {_show(v)}")
        return v

    def float(self, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
        """A finite number in [lo, hi] (or (lo, hi]); ints are compared exactly before
        float() so no value overflows."""
        v = self.obj.get(key)
        if v is None:
            return default
        if type(v) not in (int, float) or (type(v) is float and not math.isfinite(v)):
            raise bad_param(self.name(key), f"must be a number, got {_show(v)}")
        if v < lo or v > hi or (lo_open and v == lo):
            low = "(" if lo_open else "["
            raise bad_param(self.name(key), f"must be in {low}{lo:g}, {hi:g}], got {_show(v)}")
        return float(v)


def _show(v: Any, limit: int = 40) -> str:
    """A value for an error message: short, whatever the client sent."""
    # repr of a huge int is slow and, past 4,300 digits, an error
    text = f"an integer of {v.bit_length()} bits" if isinstance(v, int) and v.bit_length() > 128 else repr(v)
    return text if len(text) <= limit else text[:limit] + "..."
