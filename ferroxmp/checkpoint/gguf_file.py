"""Read a GGUF file's header: metadata key/values and tensor infos; tensors on demand.

Why not `gguf.GGUFReader` for the header: it builds a numpy view per string, and a
tokenizer holds ~100k strings, so opening SmolLM2's file takes 2-6 s in every process
that reads it. Parsing the header with `struct` takes a tenth of that. The layout is
GGUF v2/v3 (little-endian); the tensor bytes are handed to `gguf.quants.dequantize`.

Invariants: `metadata` holds Python values (str, int, float, bool, lists of them);
`tensors` keeps file order; `raw(name)` is a read-only uint8 view of the mapped file
shaped (*outer dims, bytes per row), the form `gguf.quants.dequantize` expects.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF file ferroxmp can read; the message says why."""


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
    def __init__(self, buf: mmap.mmap, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _NP:  # numbers: one numpy read, not `count` struct calls
                arr = np.frombuffer(self.buf, dtype=_NP[itype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: metadata value type {vtype} is not a GGUF type (corrupt file?)")
        return self.scalar(_SCALARS[vtype])


def open_gguf(path: str) -> GGUFFile:
    """Parse the header of `path`; tensor bytes stay in the mapped file until `raw()`."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (no GGUF magic)")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.scalar("<I")
    if version & 0xFFFF == 0:
        raise GGUFError(f"{path} is a big-endian GGUF file; ferroxmp reads little-endian GGUF only")
    if version not in (2, 3):
        raise GGUFError(f"{path} is GGUF version {version}; ferroxmp reads versions 2 and 3")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    tensors: dict[str, TensorInfo] = {}
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
        tensors[name] = TensorInfo(name, dims, cur.scalar("<I"), cur.scalar("<Q"))
    align = int(metadata.get("general.alignment", 32))
    data_offset = (cur.pos + align - 1) // align * align
    return GGUFFile(path, version, metadata, tensors, data_offset, buf)
