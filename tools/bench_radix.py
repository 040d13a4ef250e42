"""Benchmark of the RadixCache: match/insert/evict time per call and tree memory.

Builds a tree of N cached sequences of L tokens (page_size 16 by default) the way the
scheduler fills it: each sequence is matched, its missing pages allocated, and the
whole sequence published. Sequences share prefixes: most start with one of G
"system prompts" of random length, the rest is random. Prints a markdown table.

    .venv/bin/python tools/bench_radix.py [--seqs 10000 --len 2000 --page-size 16]
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ferroxmp.page_pool import PagePool  # noqa: E402
from ferroxmp.radix import RadixCache  # noqa: E402


def make_sequences(args: argparse.Namespace) -> list[np.ndarray]:
    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(0, args.vocab, rng.integers(args.len // 8, args.len // 2), dtype=np.int32)
                for _ in range(args.groups)]
    seqs = []
    for _ in range(args.seqs):
        head = prefixes[rng.integers(args.groups)] if rng.random() < args.shared else np.empty(0, np.int32)
        tail = rng.integers(0, args.vocab, args.len - len(head), dtype=np.int32)
        seqs.append(np.concatenate([head, tail]))
    return seqs


def build(tree: RadixCache, pool: PagePool, seqs: list[np.ndarray], times: dict | None) -> None:
    """Admit-and-publish every sequence; times[...] gets per-call seconds when given."""
    ps = tree.page_size
    for seq in seqs:
        ids = seq.tolist()  # the scheduler holds a request's ids as a list
        t0 = time.perf_counter()
        m = tree.match_prefix(ids)
        t1 = time.perf_counter()
        fresh = pool.alloc(math.ceil(len(ids) / ps) - len(m.pages))
        if fresh is None:
            raise SystemExit("pool too small for the benchmark")
        t2 = time.perf_counter()
        tree.insert(ids, m.pages + fresh)
        t3 = time.perf_counter()
        pool.release(fresh)  # the row ends; the tree keeps its own ref
        if times is not None:
            times["match, cold build (miss or partial hit)"].append(t1 - t0)
            times["insert, new sequence"].append(t3 - t2)


def stats(xs: list[float]) -> str:
    a = np.array(xs) * 1e6
    return f"| {len(a):>6} | {a.mean():8.1f} | {np.percentile(a, 50):8.1f} | {np.percentile(a, 99):8.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=10_000)
    ap.add_argument("--len", type=int, default=2_000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--groups", type=int, default=100, help="distinct shared prefixes")
    ap.add_argument("--shared", type=float, default=0.8, help="fraction of sequences with one")
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--queries", type=int, default=5_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    seqs = make_sequences(args)
    num_pages = args.seqs * math.ceil(args.len / args.page_size) + 16
    pool = PagePool.create(num_pages, 1, 1)
    try:
        times: dict[str, list[float]] = {"match, cold build (miss or partial hit)": [],
                                         "insert, new sequence": []}
        tree = RadixCache(pool, args.page_size)
        gc.disable()  # a collection in the middle of one call is noise, not the tree's cost
        build(tree, pool, seqs, times)

        rng = np.random.default_rng(args.seed + 1)
        hit, dup, hit_np = [], [], []
        for i in rng.integers(0, args.seqs, args.queries):
            ids = seqs[i].tolist()
            t0 = time.perf_counter()
            m = tree.match_prefix(ids)
            t1 = time.perf_counter()
            tree.insert(ids, m.pages)
            t2 = time.perf_counter()
            tree.match_prefix(seqs[i])
            t3 = time.perf_counter()
            assert m.length == len(ids)
            hit.append(t1 - t0)
            dup.append(t2 - t1)
            hit_np.append(t3 - t2)
        times["match, full hit (list ids)"] = hit
        times["match, full hit (int32 ndarray ids)"] = hit_np
        times["insert, already cached"] = dup
        n_nodes = sum(1 for _ in tree._nodes())
        tokens, pages = tree.total_size, tree.num_pages

        ev = []
        for _ in range(min(1000, args.seqs // 2)):
            t0 = time.perf_counter()
            freed = tree.evict(math.ceil(args.len / args.page_size))
            ev.append(time.perf_counter() - t0)
            assert freed > 0
        times[f"evict {math.ceil(args.len / args.page_size)} pages (LRU leaves)"] = ev
        gc.enable()
        tree.check_integrity()
        tree.reset()
        pool.check_integrity()

        # Memory on a second, traced build (tracemalloc slows every call, so the
        # timings above come from the untraced one).
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        tree = RadixCache(pool, args.page_size)
        build(tree, pool, seqs, None)
        gc.collect()
        mem = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        tree.reset()
    finally:
        pool.close()
        pool.unlink()

    print(f"RadixCache benchmark: {args.seqs} sequences x {args.len} tokens, page_size "
          f"{args.page_size}, {args.groups} shared prefixes on {args.shared:.0%} of them; "
          f"Python {platform.python_version()}, {platform.machine()}")
    print(f"tree: {tokens:,} tokens in {pages:,} pages, {n_nodes:,} nodes; "
          f"memory {mem / 2**20:.1f} MiB ({mem / max(tokens, 1):.2f} bytes/token, "
          f"{mem / max(pages, 1):.0f} bytes/page) by tracemalloc\n")
    print("| operation | calls | mean µs | p50 µs | p99 µs |")
    print("|---|---:|---:|---:|---:|")
    for name, xs in times.items():
        print(f"| {name} " + stats(xs))


if __name__ == "__main__":
    main()
