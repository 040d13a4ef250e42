"""PrefixTree: an approximate record of the text the router sent to one backend.

The router has no tokenizer (backends may even serve different ones), so the tree
is over characters, cut into blocks of `block_chars` the way the server's radix
cache cuts tokens into pages. A node is a block identified by the hash of its
whole path (parent's id, block text): node i exists iff blocks 0..i of some text
were inserted, so "longest prefix" is the number of leading block ids present.
That makes the tree a plain dict of ids, with O(1) lookups per block and no
pointer structure to rebalance, at the cost of block granularity (a prefix
shorter than one block never matches) and a 2**-64 chance per lookup that two
different paths share an id (a misrouted request, never a wrong answer: the
backend's own cache decides what it reuses).

Memory is bounded by `max_blocks` per tree: inserting touches a text's blocks
deepest-first, so an ancestor is always more recently used than its
descendants and least-recently-used eviction removes leaves before the nodes
they hang from (the server's radix tree evicts the same way).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field


def block_ids(text: str, block_chars: int) -> list[int]:
    """The ids of every whole block of `text`, root first; a trailing partial block has none."""
    ids, parent = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = hash((parent, text[start:start + block_chars]))
        ids.append(parent)
    return ids


@dataclass
class PrefixTree:
    block_chars: int = 32
    max_blocks: int = 65536
    _nodes: OrderedDict = field(default_factory=OrderedDict, repr=False)  # id -> parent id, LRU first
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.block_chars < 1 or self.max_blocks < 1:
            raise ValueError(f"block_chars and max_blocks must be >= 1, got {self.block_chars}, {self.max_blocks}")

    @property
    def size(self) -> int:
        return len(self._nodes)

    def match(self, ids: list[int]) -> int:
        """How many leading blocks of `ids` the tree holds (no LRU touch: a lookup
        for a request routed elsewhere must not keep these blocks alive)."""
        n = 0
        with self._lock:
            for i in ids:
                if i not in self._nodes:
                    break
                n += 1
        return n

    def insert(self, ids: list[int]) -> None:
        """Record `ids` as sent here, then evict least-recently-used blocks beyond the bound."""
        with self._lock:
            for depth in range(len(ids) - 1, -1, -1):  # deepest first: the root ends up most recent
                self._nodes[ids[depth]] = ids[depth - 1] if depth else 0
                self._nodes.move_to_end(ids[depth])
            while len(self._nodes) > self.max_blocks:
                self._nodes.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._nodes.clear()

    def check_integrity(self) -> None:
        """Bounded, and every block's parent is present and more recently used than it."""
        with self._lock:
            assert len(self._nodes) <= self.max_blocks, (len(self._nodes), self.max_blocks)
            rank = {node: i for i, node in enumerate(self._nodes)}
            for node, parent in self._nodes.items():
                assert parent == 0 or rank.get(parent, -1) > rank[node], f"block {node} outlived its parent"

