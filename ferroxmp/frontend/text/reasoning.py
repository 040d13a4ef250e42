"""--reasoning-parser: split a reasoning model's thinking (<think> ... </think>) from its answer.

One `ReasoningSplitter` per choice, fed the choice's text as it is released (after stop
strings); it returns (reasoning, content) pieces. Every dialect reads the same split
(Generation puts it on each Delta): chat completions' `reasoning_content`, Messages'
thinking blocks, Responses' reasoning items; tool-call parsing sees only the content.

Where the reply starts is read from the rendered prompt's tail: a prompt that opened a
think block and did not close it (DeepSeek-R1's template, Qwen3 with thinking forced)
starts in reasoning; one that closed it (Qwen3 with `enable_thinking: false`) starts in
the answer; otherwise `qwen3` looks for a leading <think> in the output and
`deepseek-r1` starts in reasoning (its distills often omit the opening tag).

Invariants: for any chunking of the same text the pieces concatenate to the same two
strings (a tag split across deltas is held back, never leaked into either side); the
tags themselves appear in neither; the blank lines after </think> are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

OPEN, CLOSE = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class ReasoningSplitter:
    in_reasoning: bool
    at_start: bool  # nothing decided yet: a leading <think> opens reasoning
    buf: str = ""
    after_close: bool = False  # just closed: blank lines before the answer are dropped

    @classmethod
    def for_prompt(cls, parser: str, prompt_tail: str) -> "ReasoningSplitter":
        opened, closed = prompt_tail.rfind(OPEN), prompt_tail.rfind(CLOSE)
        if opened > closed:
            return cls(True, False)
        if closed > opened:
            return cls(False, False)
        return cls(parser == "deepseek-r1", True)

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = ""
        if self.at_start:
            s = self.buf.lstrip()
            if s.startswith(OPEN):
                self.buf, self.in_reasoning, self.at_start = s[len(OPEN):], True, False
            elif OPEN.startswith(s):  # empty, or what may still become <think>
                return "", ""
            else:
                self.at_start = False
        if self.in_reasoning:
            i = self.buf.find(CLOSE)
            if i < 0:
                keep = _held(self.buf, CLOSE)
                cut = len(self.buf) - keep
                reasoning, self.buf = self.buf[:cut], self.buf[cut:]
                return reasoning, ""
            reasoning, self.buf = self.buf[:i], self.buf[i + len(CLOSE):]
            self.in_reasoning, self.after_close = False, True
        content, self.buf = self.buf, ""
        if self.after_close:
            content = content.lstrip("\n")
            self.after_close = not content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the reply: what was held back is released on its side."""
        rest, self.buf = self.buf, ""
        if self.in_reasoning:
            return rest, ""
        return "", rest.lstrip("\n") if self.after_close else rest


def splitter_factory(parser: Optional[str], prompt_tail: str):
    """A per-choice factory, or None without a parser."""
    if not parser or parser == "none":
        return None
    return lambda: ReasoningSplitter.for_prompt(parser, prompt_tail)
