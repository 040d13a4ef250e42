"""The disk tier: one file per KV page, in a directory per model fingerprint.

Job: write a page's bytes durably enough that a torn write is never read back, read
a page back only if it is whole and unaltered, keep the directory under its byte
bound (least recently used first), and rebuild the index from the directory at start.

File `<key hex>.kv` (mode 0600; directory 0700): a 36-byte header — magic "FXKV",
format version, CRC-32 of the payload, the 16-byte key, the payload length — then
the payload (K and V of every layer, in the pool's layout). A write goes to a `.tmp`
name and is renamed into place, so a kill -9 leaves either the whole file or a
`.tmp` that the next start removes. A file whose size, header or checksum is wrong
is deleted with a log line and reported as a failed load: recomputed, never used.

The index (key -> bytes, in LRU order) is shared by the writer and loader threads
(`kv/tiers.py`), under one lock.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from typing import Optional

log = logging.getLogger("ferroxmp.kv_disk")

FORMAT_VERSION = 1
MAGIC = b"FXKV"
HEADER = struct.Struct("<4sII16sQ")  # magic, version, crc32, key, payload length
SUFFIX = ".kv"
KEY_BYTES = 16


def weights_digest(model_path: str, cache_root: str) -> str:
    """A digest of the checkpoint's bytes (the .gguf file, or a folder's config and
    weight files). Hashing gigabytes takes seconds, so the digest is remembered in
    `cache_root/digests.json` by (path, size, mtime)."""
    if os.path.isdir(model_path):
        files = sorted(os.path.join(model_path, f) for f in os.listdir(model_path)
                       if f.endswith((".safetensors", ".bin", ".gguf")) or f == "config.json")
    else:
        files = [model_path]
    stamp = [[os.path.realpath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]
    memo_path = os.path.join(cache_root, "digests.json")
    memo_key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()
    try:
        with open(memo_path, encoding="utf-8") as f:
            memo = json.load(f)
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    if isinstance(memo.get(memo_key), str):
        return memo[memo_key]
    h = hashlib.blake2b(digest_size=16)
    for path in files:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    memo[memo_key] = digest
    tmp = memo_path + f".{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        json.dump(memo, f)
    os.replace(tmp, memo_path)
    return digest


def fingerprint(parts: dict) -> str:
    """The directory name for KV computed by this model, dtype, page size, layout, ...:
    KV written under any other fingerprint is never read."""
    return hashlib.sha256(json.dumps({**parts, "format": FORMAT_VERSION}, sort_keys=True).encode()).hexdigest()[:32]


def _private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


class DiskTier:
    def __init__(self, root: str, fp: str, limit_bytes: int, payload_bytes: int):
        _private_dir(root)
        self.dir = os.path.join(root, fp)
        _private_dir(self.dir)
        self.limit_bytes = limit_bytes
        self.payload_bytes = payload_bytes
        self.faults = None  # test-only fault injection (faults.py): a slow disk
        self.file_bytes = HEADER.size + payload_bytes
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recently used first
        self.lock = threading.Lock()
        self._scan()

    @property
    def used_bytes(self) -> int:
        return len(self.index) * self.file_bytes

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + SUFFIX)

    def _scan(self) -> None:
        """Rebuild the index from the directory: whole-sized page files, oldest first;
        leftovers of a killed writer (.tmp) and anything malformed are removed."""
        found = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            stem, ext = os.path.splitext(name)
            try:
                key = bytes.fromhex(stem) if ext == SUFFIX else b""
                st = os.stat(path)
            except (ValueError, OSError):
                key, st = b"", None
            if len(key) != KEY_BYTES or st is None or st.st_size != self.file_bytes:
                log.warning("kv disk tier: removing %s (%s)", name,
                            "an unfinished write" if name.endswith(".tmp") else "not a whole page file")
                try:
                    os.unlink(path)
                except OSError:
                    pass
                continue
            found.append((st.st_mtime_ns, key))
        for _, key in sorted(found):
            self.index[key] = self.file_bytes
        if found:
            log.info("kv disk tier: %d pages (%.1f MiB) found in %s", len(found), self.used_bytes / 2**20, self.dir)

    def write(self, key: bytes, payload: memoryview) -> list[bytes]:
        """Store one page; returns the keys deleted to stay under the bound. Raises
        OSError (a full or failing disk): the caller drops the page."""
        if self.faults is not None:
            self.faults.before_disk_io()
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)
                return []
        header = HEADER.pack(MAGIC, FORMAT_VERSION, zlib.crc32(payload), key, len(payload))
        final = self._path(key)
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.rename(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        with self.lock:
            self.index[key] = self.file_bytes
            gone = []
            while self.used_bytes > self.limit_bytes and len(self.index) > 1:
                old, _ = self.index.popitem(last=False)
                gone.append(old)
        for old in gone:
            self._unlink(old)
        return gone

    def read_into(self, key: bytes, out: memoryview) -> bool:
        """Fill `out` (payload_bytes) with the page of `key`; False, with the file
        deleted, when it is missing, torn or altered."""
        if self.faults is not None:
            self.faults.before_disk_io()
        path = self._path(key)
        why = None
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                n = f.readinto(out) if len(head) == HEADER.size else 0
                extra = f.read(1)
        except OSError as e:
            why = f"unreadable ({e.strerror})"
        if why is None:
            if len(head) != HEADER.size or n != self.payload_bytes or extra:
                why = "truncated or overlong"
            else:
                magic, version, crc, fkey, length = HEADER.unpack(head)
                if magic != MAGIC or version != FORMAT_VERSION or fkey != key or length != self.payload_bytes:
                    why = "foreign header"
                elif zlib.crc32(out) != crc:
                    why = "checksum mismatch"
        if why is None:
            with self.lock:
                if key in self.index:
                    self.index.move_to_end(key)
            return True
        log.warning("kv disk tier: page %s dropped: %s; recomputing it", key.hex(), why)
        with self.lock:
            self.index.pop(key, None)
        self._unlink(key)
        return False

    def clear(self) -> list[bytes]:
        with self.lock:
            keys = list(self.index)
            self.index.clear()
        for key in keys:
            self._unlink(key)
        return keys

    def _unlink(self, key: bytes) -> None:
        try:
            os.unlink(self._path(key))
        except OSError:
            pass

    def keys(self) -> list[bytes]:
        with self.lock:
            return list(self.index)

    def contains(self, key: bytes) -> bool:
        with self.lock:
            return key in self.index


def open_disk_tier(root: Optional[str], parts: dict, limit_gb: float, payload_bytes: int) -> Optional[DiskTier]:
    if not root:
        return None
    return DiskTier(root, fingerprint(parts), int(limit_gb * 2**30), payload_bytes)
