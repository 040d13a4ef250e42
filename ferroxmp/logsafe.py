"""SafeFormatter: one log record is one line, whatever a client sent.

Job: escape control characters and cut long values in every log record, once, in
the formatter `setup_logging` installs — so no call site that logs a model name,
a field value or an exception message can forget, and a newline in a client's
string never writes a line that looks like a record of its own.

Invariants:
- A record's message holds no control character (C0, DEL, C1) and no Unicode line
  or paragraph separator: each is written as a visible escape (\\n, \\x1b, \\u2028).
- A string argument longer than MAX_ARG_CHARS and a message longer than
  MAX_MESSAGE_CHARS are cut, saying how much was cut.
- A traceback keeps its line breaks (it is ours), but every line of it is
  indented, so no line of it can pass for a record (records start at column 0).
"""
from __future__ import annotations

import logging
import unicodedata

MAX_ARG_CHARS = 300
MAX_MESSAGE_CHARS = 4000
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_table(keep: str = "") -> dict[int, str]:
    table = {}
    for cp in list(range(0x20)) + list(range(0x7F, 0xA0)) + [0x2028, 0x2029]:
        c = chr(cp)
        if c in keep:
            continue
        if c in _NAMED:
            table[cp] = _NAMED[c]
        else:
            table[cp] = f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}"
    return table


_ESCAPE = _escape_table()
_ESCAPE_KEEP_NEWLINES = _escape_table(keep="\n")
assert all(unicodedata.category(chr(c)) in ("Cc", "Zl", "Zp") for c in _ESCAPE)


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more characters]"


def escape(text: str) -> str:
    return text.translate(_ESCAPE)


def _safe_arg(a):
    return cut(a, MAX_ARG_CHARS) if isinstance(a, str) else a


class SafeFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if isinstance(record.args, tuple):
            record.args = tuple(_safe_arg(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _safe_arg(v) for k, v in record.args.items()}
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(cut(record.message, MAX_MESSAGE_CHARS))
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    lines = text.translate(_ESCAPE_KEEP_NEWLINES).split("\n")
    return "\n".join("    " + line for line in lines)
