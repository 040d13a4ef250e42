"""Grammar compilation off the worker's batch loop.

Job: take the scheduler's PrepareGrammar messages, compile each spec into the
runner's GrammarCache on a compile thread (llguidance drops the GIL while it builds,
so the batch loop keeps stepping), and answer GrammarReady (ok or the engine's error)
on the thread's own PUSH socket to the scheduler.

Invariants:
- The batch loop never compiles a prepared spec: `submit` only queues it. (A spec
  evicted from the LRU between its GrammarReady and its row is compiled again inline
  by the runner; the cache holds 256, so that needs 256 other specs in between.)
- Every PrepareGrammar gets exactly one GrammarReady, whatever the compile raises.
- A ZMQ socket is used by one thread only: each compile thread owns its socket (made
  for it before it starts).
- Threads are daemons: a compile still running when the worker exits never holds it
  up (the scheduler's --max-grammar-compile-seconds has answered that request with a
  400 already; llguidance's LLParserLimits bound the work of the compile itself).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

import zmq

from ferroxmp import protocol

log = logging.getLogger("ferroxmp.worker")
THREADS = 2  # compiles at once: one slow spec does not hold up the next small one


class GrammarPrep:
    def __init__(self, ctx: zmq.Context, endpoint: str, cache: Callable[[], object], faults=None):
        self._get_cache, self._faults = cache, faults
        self._cache_lock = threading.Lock()  # the first compiles build the cache once
        self._jobs: "queue.Queue[Optional[protocol.PrepareGrammar]]" = queue.Queue()
        # The sockets are made here, before any thread starts (Thread.start is the memory
        # barrier a socket needs to change threads), so the context knows each from the
        # first: a worker whose exit began while a thread was still making its own socket
        # waited forever in ctx.destroy (it closes the sockets it knows, then waits for all).
        self._threads = []
        for i in range(THREADS):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._threads.append(threading.Thread(target=self._run, args=(sock,), name=f"grammar-{i}", daemon=True))
        for t in self._threads:
            t.start()

    def submit(self, msg: protocol.PrepareGrammar) -> None:
        self._jobs.put(msg)

    def stop(self, wait_s: float = 1.0) -> None:
        """End the threads (each closes its socket); a compile still running is left to
        its daemon thread after `wait_s` (ctx.destroy then closes its socket)."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + wait_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(self, sock: zmq.Socket) -> None:
        try:
            while (msg := self._jobs.get()) is not None:
                sock.send(protocol.encode(self.prepare(msg)))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def prepare(self, msg: protocol.PrepareGrammar) -> protocol.GrammarReady:
        try:
            with self._cache_lock:
                cache = self._get_cache()
        except Exception as e:  # e.g. the tokenizer would not load: every request says so
            log.exception("the grammar cache could not be built")
            return protocol.GrammarReady(msg.rid, error=f"the grammar engine failed: {type(e).__name__}: {e}"[:300])
        return prepare(cache, msg, self._faults)


def prepare(cache, msg: protocol.PrepareGrammar, faults=None) -> protocol.GrammarReady:
    """Compile (or find) msg's grammar in `cache`; the answer never raises. (In-process
    drivers of the scheduler core, tests/engine.py, call it inline.)"""
    t0 = time.perf_counter()
    try:
        if faults is not None and not cache.cached(msg.grammar):
            faults.before_grammar_compile(msg.grammar.spec)
        _, hit, _ = cache.compile(msg.grammar)
        return protocol.GrammarReady(msg.rid, cached=hit, compile_s=0.0 if hit else time.perf_counter() - t0)
    except ValueError as e:  # GrammarError: the spec itself
        return protocol.GrammarReady(msg.rid, error=str(e), compile_s=time.perf_counter() - t0)
    except Exception as e:  # an engine bug must not leave the request pending forever
        log.exception("compiling the grammar of %s failed", msg.rid)
        return protocol.GrammarReady(msg.rid, error=f"the grammar engine failed: {type(e).__name__}: {e}"[:300],
                                     compile_s=time.perf_counter() - t0)
