"""Prefix sharing: the RadixCache (tree of token pages) and the PagePool (refcounts
and the page table in shared memory). Imports nothing else of ferroxmp; the worker
imports only `ferroxmp.radix.pages`."""
from ferroxmp.radix.pages import PageError, PagePool
from ferroxmp.radix.tree import MatchResult, RadixCache, RadixError

__all__ = ["MatchResult", "PageError", "PagePool", "RadixCache", "RadixError"]
