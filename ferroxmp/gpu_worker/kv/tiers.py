"""KVTiers: the worker's tiers under the KV pool — host memory and disk.

Job: the one owner of every page kept outside the pool. The scheduler decides what to
save and load (it owns the tree); this class does the copying, and reports what each
tier holds (`KVTierReport`), which is the only way the scheduler's index changes.

- `save` (a KVSave, on the batch loop): the pages are copied out of the pool at once,
  because the next batch may reuse them; that copy is a memcpy per page. Then they go
  to the host tier (an eviction) or to the disk writer's queue (`to_disk`). The host
  tier is an LRU bounded by --kv-host-gb; what it evicts goes to disk (when there is a
  disk tier and the page is not on it) or is dropped.
- The disk writer is a thread with a bounded queue: a full queue drops the page and
  counts it (`stores_dropped`), it never blocks a step. It also applies flushes, in
  order after the writes queued before them.
- `load` (a KVLoad) runs on the loader thread: each page from the host tier or its
  file (checked: `kv/disk.py`) into its pool page — pages the scheduler allocated for
  the load and no batch reads — then one KVLoaded with how many leading pages made it.
  The pages of a load are read by LOAD_THREADS threads at once: one page at a time
  left the disk idle while a page was checked and copied (0.3x a plain sequential read
  of the same files, measured). On CUDA the copies run on side streams.

Threads send on their own sockets (`make_sender()` is called in the thread), since a
zmq socket is not thread-safe.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from ferroxmp.protocol import (KV_SECONDS_BUCKETS, KVFlush, KVLoad, KVLoaded, KVSave, KVTierReport, KVTierStats,
                        unpack_ids)
from ferroxmp.gpu_worker.kv.disk import DiskTier, open_disk_tier, weights_digest
from ferroxmp.gpu_worker.kv.pool import KVPool

log = logging.getLogger("ferroxmp.kv_tiers")

WRITE_QUEUE_PAGES = 1024  # pages waiting for the disk writer before saves are dropped
WARN_EVERY_S = 30.0  # at most one "page not written" log line per this many seconds
LOAD_THREADS = 4  # pages of one load read at once (file reads, checksums and copies drop the GIL)
Sender = Callable[[object], None]


def _bucket(counts: list[int], seconds: float) -> None:
    counts[bisect.bisect_left(KV_SECONDS_BUCKETS, seconds)] += 1


class KVTiers:
    def __init__(self, kv: KVPool, host_bytes: int, disk: Optional[DiskTier],
                 make_sender: Callable[[], Sender]):
        self.kv = kv
        self.disk = disk
        self.host_limit = host_bytes
        self.host: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # LRU, oldest first
        self.lock = threading.Lock()  # the host dict and the stats
        self.stats = KVTierStats(store_counts=[0] * (len(KV_SECONDS_BUCKETS) + 1),
                                 load_counts=[0] * (len(KV_SECONDS_BUCKETS) + 1))
        view = self._views(0)[0]
        self.page_shape = (2,) + tuple(view.shape)
        self.page_bytes = 2 * view.numel() * view.element_size()
        self.pin = kv.device.type == "cuda"
        self.writes: queue.Queue = queue.Queue(WRITE_QUEUE_PAGES)
        self.loads: queue.Queue = queue.Queue()
        self.make_sender = make_sender
        self._threads = []
        self._warned_at = -WARN_EVERY_S
        self._local = threading.local()  # each load thread's page buffer and CUDA stream
        self._readers = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-load")
        if disk is not None:
            self._start(self._writer, "kv-writer")
        self._start(self._loader, "kv-loader")

    def _start(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # -- pages in the pool ------------------------------------------------------------

    def _views(self, page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one page in every layer, in the pool's layout (views)."""
        span = slice(page * self.kv.page_size, (page + 1) * self.kv.page_size)
        if self.kv.layout == "hnd":
            return self.kv.k[:, :, span], self.kv.v[:, :, span]
        return self.kv.k[:, span], self.kv.v[:, span]

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.page_shape, dtype=self.kv.dtype, pin_memory=self.pin)

    def _copy_out(self, page: int) -> torch.Tensor:
        k, v = self._views(page)
        buf = self._buffer()
        buf[0].copy_(k)
        buf[1].copy_(v)
        return buf

    def _copy_in(self, page: int, buf: torch.Tensor) -> None:
        k, v = self._views(page)
        k.copy_(buf[0], non_blocking=self.pin)
        v.copy_(buf[1], non_blocking=self.pin)

    # -- the batch loop's side ------------------------------------------------------

    def save(self, msg: KVSave) -> Optional[KVTierReport]:
        pages = unpack_ids(msg.pages).tolist()
        report = KVTierReport()
        for page, key in zip(pages, msg.keys):
            buf = self._copy_out(page)
            if msg.to_disk or self.host_limit <= 0:
                self._queue_write(key, buf)
            else:
                self._host_put(key, buf, report)
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return self._with_stats(report) if report.stored or report.dropped else None

    def _host_put(self, key: bytes, buf: torch.Tensor, report: KVTierReport) -> None:
        spill = []
        with self.lock:
            self.host[key] = buf
            self.host.move_to_end(key)
            report.stored.append(key)
            report.stored_tiers += "h"
            while len(self.host) * self.page_bytes > self.host_limit:
                old, old_buf = self.host.popitem(last=False)
                report.dropped.append(old)
                report.dropped_tiers += "h"
                spill.append((old, old_buf))
        for old, old_buf in spill:  # next tier down, unless it is there already
            if self.disk is not None and not self.disk.contains(old):
                self._queue_write(old, old_buf)

    def _queue_write(self, key: bytes, buf: torch.Tensor) -> None:
        if self.disk is None:
            return
        try:
            self.writes.put_nowait(("write", key, buf))
        except queue.Full:
            with self.lock:
                self.stats.stores_dropped += 1

    def handle(self, msg) -> Optional[KVTierReport]:
        """A KVSave, KVLoad or KVFlush from the scheduler; a report to send back, if any."""
        if isinstance(msg, KVSave):
            return self.save(msg)
        if isinstance(msg, KVLoad):
            self.loads.put(msg)
            return None
        return self.flush(msg)

    def describe(self) -> dict:
        """For /server_info."""
        return {"host_gb": self.host_limit / 2**30, "page_bytes": self.page_bytes,
                "disk_dir": self.disk.dir if self.disk is not None else None,
                "disk_gb": self.disk.limit_bytes / 2**30 if self.disk is not None else 0.0,
                "disk_pages_at_start": len(self.disk.index) if self.disk is not None else 0}

    def flush(self, msg: KVFlush) -> KVTierReport:
        with self.lock:
            keys = list(self.host)
            self.host.clear()
        if self.disk is not None:
            self.writes.put(("flush", b"", None))  # after every write queued before it
        return self._with_stats(KVTierReport(dropped=keys, dropped_tiers="h" * len(keys)))

    def initial_report(self) -> KVTierReport:
        """What the disk tier held at start (the index rebuilt from the directory)."""
        keys = self.disk.keys() if self.disk is not None else []
        return self._with_stats(KVTierReport(stored=keys, stored_tiers="d" * len(keys)))

    def _with_stats(self, report: KVTierReport) -> KVTierReport:
        with self.lock:
            s = self.stats
            s.host_bytes = len(self.host) * self.page_bytes
            if self.disk is not None:
                s.disk_bytes = self.disk.used_bytes
            s.store_queue = self.writes.qsize()
            report.stats = KVTierStats(**{f: (list(getattr(s, f)) if isinstance(getattr(s, f), list)
                                              else getattr(s, f)) for f in s.__struct_fields__})
        return report

    # -- threads --------------------------------------------------------------------

    def _writer(self) -> None:
        send = self.make_sender()
        while True:
            op, key, buf = self.writes.get()
            report = KVTierReport()
            if op == "flush":
                gone = self.disk.clear()
                report.dropped, report.dropped_tiers = gone, "d" * len(gone)
            else:
                t0 = time.perf_counter()
                try:
                    gone = self.disk.write(key, memoryview(buf.numpy()).cast("B"))
                except OSError as e:
                    with self.lock:
                        self.stats.stores_dropped += 1
                    self._warn_dropped(e)
                    gone = None
                if gone is not None:
                    dt = time.perf_counter() - t0
                    with self.lock:
                        _bucket(self.stats.store_counts, dt)
                        self.stats.store_seconds += dt
                        self.stats.stored_bytes += self.page_bytes
                    report.stored, report.stored_tiers = [key], "d"
                    report.dropped, report.dropped_tiers = gone, "d" * len(gone)
            send(self._with_stats(report))
            self.writes.task_done()

    def _warn_dropped(self, error: OSError) -> None:
        """One log line per WARN_EVERY_S at most: a full disk fails every write, and a
        line per page would flood the log (the count is in the metrics)."""
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning("kv disk tier: page not written (%s); %d pages dropped so far "
                        "(ferroxmp_kv_store_dropped_total); they are recomputed if needed",
                        error, self.stats.stores_dropped)
            self._warned_at = now

    def _loader(self) -> None:
        send = self.make_sender()
        while True:
            msg: KVLoad = self.loads.get()
            t0 = time.perf_counter()
            got = list(self._readers.map(self._load_page, unpack_ids(msg.pages).tolist(), msg.keys))
            ok = got.index("") if "" in got else len(got)  # the leading pages that made it
            failed = [key for key, tier in zip(msg.keys, got) if not tier]
            dt = time.perf_counter() - t0
            with self.lock:
                _bucket(self.stats.load_counts, dt)
                self.stats.load_seconds += dt
                self.stats.loaded_bytes += ok * self.page_bytes
                self.stats.load_failures += len(failed)
            send(KVLoaded(msg.load_id, ok, "".join(got[:ok]), dt))
            # The stats go with a report after every load, so /metrics shows the load now
            # rather than with the next store; a failed key is in no tier any more, as far
            # as the scheduler should know.
            send(self._with_stats(KVTierReport(dropped=failed * 2, dropped_tiers="h" * len(failed) + "d" * len(failed))))
            self.loads.task_done()

    def _load_page(self, page: int, key: bytes) -> str:
        """One page into pool page `page` (on a load thread): "h" or "d" for the tier it
        came from, "" when no tier has it (a bad file is deleted by read_into)."""
        local = self._local
        if not hasattr(local, "buf"):
            local.buf = self._buffer()
            local.stream = torch.cuda.Stream(self.kv.device) if self.pin else None
        with self.lock:
            src = self.host.get(key)
            if src is not None:
                self.host.move_to_end(key)
        tier = ""
        with torch.cuda.stream(local.stream) if local.stream is not None else contextlib.nullcontext():
            if src is not None:
                self._copy_in(page, src)
                tier = "h"
            elif self.disk is not None and self.disk.read_into(key, memoryview(local.buf.numpy()).cast("B")):
                self._copy_in(page, local.buf)
                tier = "d"
            if tier and local.stream is not None:
                local.stream.synchronize()  # the buffer is reused for this thread's next page
        return tier

    def close(self, timeout: float = 4.0) -> None:  # within the supervisor's 5 s teardown
        """At shutdown: give the disk writer up to `timeout` to finish what is queued, so
        a SIGTERM'd server's pages are on disk for the next one (kill -9 loses the queue
        only: the files are whole or absent)."""
        deadline = time.time() + timeout
        while self.disk is not None and self.writes.unfinished_tasks and time.time() < deadline:
            time.sleep(0.01)

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until both queues are empty and their last item is done (tests)."""
        deadline = time.time() + timeout
        while (self.writes.unfinished_tasks or self.loads.unfinished_tasks) and time.time() < deadline:
            time.sleep(0.005)


def open_tiers(sa, runner, model_path: str, make_sender: Callable[[], Sender]) -> Optional[KVTiers]:
    """The tiers --kv-host-gb / --kv-cache-dir ask for, over the runner's pool, or None.
    The disk directory is chosen by the fingerprint of everything that decides a page's
    bytes: the weights, dtype, page size, KV geometry and layout, --tp, quantization and
    the deterministic kernels."""
    if not sa.kv_host_gb and not sa.kv_cache_dir:
        return None
    kv = runner.kv
    disk = None
    if sa.kv_cache_dir:
        os.makedirs(sa.kv_cache_dir, mode=0o700, exist_ok=True)
        parts = {"weights": weights_digest(model_path, sa.kv_cache_dir), "dtype": str(kv.dtype),
                 "page_size": kv.page_size, "layers": kv.num_layers, "kv_heads": kv.num_kv_heads,
                 "head_dim": kv.head_dim, "layout": kv.layout, "tp": sa.tp,
                 "quantization": getattr(runner, "quantization", sa.quantization),
                 "deterministic": sa.deterministic, "device": kv.device.type}
        per_page = 2 * kv.num_layers * kv.page_size * kv.num_kv_heads * kv.head_dim * kv.k.element_size()
        disk = open_disk_tier(sa.kv_cache_dir, parts, sa.kv_disk_gb, per_page)
    tiers = KVTiers(kv, int(sa.kv_host_gb * 2**30), disk, make_sender)
    log.info("KV tiers: %s", tiers.describe())
    return tiers
