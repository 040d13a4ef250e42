"""Read a GGUF file's header: metadata key/values and tensor infos; tensors on demand.

Why not `gguf.GGUFReader` for the header: it builds a numpy view per string, and a
tokenizer holds ~100k strings, so opening SmolLM2's file takes 2-6 s in every process
that reads it. Parsing the header with `struct` takes a tenth of that. The layout is
GGUF v2/v3 (little-endian); the tensor bytes are handed to `gguf.quants.dequantize`.

Invariants: nothing is trusted before it is checked against the file: counts, string
and array lengths cannot run past its end, a tensor has 1-4 dims, a known GGML type
and data that tiles the data section as writers lay it out (aligned, in order, ending
where the file ends); any violation is a GGUFError (a CheckpointError) naming the field.
`metadata` holds Python values (str, int, float, bool, lists of them); `tensors` keeps
file order; `raw(name)` is a read-only uint8 view of the mapped file shaped (*outer
dims, bytes per row), the form `gguf.quants.dequantize` expects.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .limits import CheckpointError

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4        # GGML_MAX_DIMS
MAX_DIM = 1 << 40   # far beyond any tensor; keeps products of dims exact in int64


class GGUFError(CheckpointError):
    """The file is not a GGUF file ferroxmp can read; the message says why, `field` what."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    type_id: int
    offset: int            # from the start of the data section

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type #{self.type_id}"

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / torch order (a Linear weight reads [out, in])."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        return self.dims[0] // block * size


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int
    _map: Any = field(default=None, repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """`{arch}.suffix`, e.g. arch_key('block_count') -> metadata['llama.block_count']."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        start = self.data_offset + info.offset
        nbytes = info.row_bytes * (info.n_elements // info.dims[0])
        if start + nbytes > len(self._map):
            raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated download?)")
        flat = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start)
        return flat.reshape(*info.shape[:-1], info.row_bytes)


class _Cursor:
    """Reads the header; every read is checked against the end of the file first, so a
    truncated or lying file is a GGUFError naming the field, never a struct.error."""

    def __init__(self, buf: mmap.mmap, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: {what} at byte {self.pos} needs {n} bytes but the file ends at byte "
                            f"{len(self.buf)}; expected a complete GGUF header (truncated file?)", what)

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def count(self, what: str, min_bytes_each: int) -> int:
        """A u64 count of items that follow, bounded by what the rest of the file can hold."""
        n = self.scalar("<Q", what)
        room = (len(self.buf) - self.pos) // max(1, min_bytes_each)
        if n > room:
            raise GGUFError(f"{self.path}: {what} is {n}; expected at most {room} (what the {len(self.buf) - self.pos} "
                            f"bytes left in the file can hold)", what)
        return n

    def string(self, what: str) -> str:
        n = self.count(f"{what} (string length)", 1)
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, nested: bool = False) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if nested:
                raise GGUFError(f"{self.path}: {what} is an array of arrays; expected an array of numbers or "
                                "strings", what)
            itype = self.scalar("<I", f"{what} (array item type)")
            if itype not in _NP and itype != _STRING and itype != _ARRAY:
                raise GGUFError(f"{self.path}: {what} (array item type) is {itype}; expected a GGUF value type "
                                "(0-12)", what)
            each = struct.calcsize(_SCALARS[itype]) if itype in _SCALARS else (8 if itype == _STRING else 12)
            count = self.count(f"{what} (array length)", each)
            if itype in _NP:  # numbers: one numpy read, not `count` struct calls
                arr = np.frombuffer(self.buf, dtype=_NP[itype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(itype, what, nested=True) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: {what} (value type) is {vtype}; expected a GGUF value type (0-12)", what)
        return self.scalar(_SCALARS[vtype], what)


def _tensor_info(cur: _Cursor, index: int) -> TensorInfo:
    name = cur.string(f"tensor #{index} name")
    what = f"tensor {name!r}"
    n_dims = cur.scalar("<I", f"{what} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"{cur.path}: {what} n_dims is {n_dims}; expected 1 to {MAX_DIMS}", f"{what} n_dims")
    dims = tuple(cur.scalar("<Q", f"{what} dims") for _ in range(n_dims))
    type_id = cur.scalar("<I", f"{what} type")
    try:
        block = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)][0]
    except (ValueError, KeyError):
        raise GGUFError(f"{cur.path}: {what} type is {type_id}; expected a GGML tensor type "
                        f"(one of {sorted(int(t) for t in GGML_QUANT_SIZES)})", f"{what} type") from None
    if not all(1 <= d <= MAX_DIM for d in dims) or dims[0] % block:
        raise GGUFError(f"{cur.path}: {what} dims are {list(dims)}; expected each in [1, {MAX_DIM}] and the "
                        f"first a multiple of {block} ({GGMLQuantizationType(type_id).name} blocks)", f"{what} dims")
    return TensorInfo(name, dims, type_id, cur.scalar("<Q", f"{what} offset"))


def _check_data(path: str, size: int, tensors: dict[str, TensorInfo], data_offset: int, align: int) -> None:
    """The tensors tile the data section as every GGUF writer lays it out: in offset
    order, each starts where the previous one's bytes end, rounded up to the alignment,
    and the file ends within one alignment step of the last. A wrong type, dims, offset
    or alignment would otherwise read other bytes without an error."""
    expected, prev = 0, None
    for info in sorted(tensors.values(), key=lambda t: t.offset):
        what = f"tensor {info.name!r} offset"
        nbytes = info.row_bytes * (info.n_elements // info.dims[0])
        if info.offset != expected:
            after = (f"where {prev.name!r} ({prev.type_name} {list(prev.dims)}) ends, aligned to {align}"
                     if prev else "the start of the data section")
            raise GGUFError(f"{path}: {what} is {info.offset}; expected {expected}, {after} (a wrong tensor "
                            "type, dims, offset or general.alignment?)", what)
        if data_offset + info.offset + nbytes > size:
            raise GGUFError(f"{path}: {what} is {info.offset} with {nbytes} bytes of data, past the end of the "
                            f"file ({size} bytes); expected data inside the file (truncated file?)", what)
        expected, prev = (info.offset + nbytes + align - 1) // align * align, info
    end = data_offset + expected
    if tensors and not end - align < size <= end:
        raise GGUFError(f"{path}: the data section ends at byte {end} but the file has {size} bytes; expected "
                        "the file to end with the last tensor (a wrong general.alignment or tensor dims?)",
                        "general.alignment")


def open_gguf(path: str) -> GGUFFile:
    """Parse the header of `path`, checked (counts, lengths, dims, types and offsets
    against the file's size); tensor bytes stay in the mapped file until `raw()`."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise GGUFError(f"{path}: the header has {os.fstat(f.fileno()).st_size} bytes; expected a GGUF "
                            "header (at least 24 bytes)", "header")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file: its magic is {bytes(buf[:4])!r}; expected b'GGUF'", "magic")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version & 0xFFFF == 0:
        raise GGUFError(f"{path}: version is {version:#x}, a big-endian GGUF file; expected little-endian GGUF "
                        "(version 2 or 3)", "version")
    if version not in (2, 3):
        raise GGUFError(f"{path}: version is {version}; expected GGUF version 2 or 3", "version")
    n_tensors = cur.count("tensor_count", 32)  # a tensor info takes at least 32 bytes
    n_kv = cur.count("metadata_kv_count", 13)  # a key/value at least 13
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if not key.strip() or not key.isprintable():
            raise GGUFError(f"{path}: metadata key #{i} is {key[:40]!r}; expected a printable name",
                            f"metadata key #{i}")
        if key in metadata:
            raise GGUFError(f"{path}: metadata key {key!r} appears twice; expected each key once", key)
        metadata[key] = cur.value(cur.scalar("<I", f"{key} (value type)"), key)
    tensors: dict[str, TensorInfo] = {}
    for i in range(n_tensors):
        info = _tensor_info(cur, i)
        if info.name in tensors:
            raise GGUFError(f"{path}: tensor {info.name!r} appears twice; expected each tensor once",
                            f"tensor {info.name!r}")
        tensors[info.name] = info
    align = metadata.get("general.alignment", 32)
    if not (isinstance(align, int) and not isinstance(align, bool) and 1 <= align <= 1 << 16
            and align & (align - 1) == 0):
        raise GGUFError(f"{path}: general.alignment is {align!r}; expected a power of two up to 65536",
                        "general.alignment")
    data_offset = (cur.pos + align - 1) // align * align
    _check_data(path, len(buf), tensors, data_offset, align)
    return GGUFFile(path, version, metadata, tensors, data_offset, buf)
