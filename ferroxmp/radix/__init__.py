"""Prefix sharing: the RadixCache, a tree of token pages over the page pool. Imports
nothing of ferroxmp but the pool (`ferroxmp/page_pool.py`, below it, which the worker
reads too); only the scheduler's cache manager uses the tree."""
from ferroxmp.radix.tree import MatchResult, RadixCache, RadixError

__all__ = ["MatchResult", "RadixCache", "RadixError"]
