"""A GGUF file's metadata and tensor table, read with `struct` from a memory map.

gguf-py's GGUFReader builds numpy views of every part of every metadata value: for the embedded
model's vocabulary (49,152 tokens and 48,900 merges) that is seconds. The loader reads scalar and
string metadata and the tensors only (transformers reads the vocabulary itself, with its own
reader), so this walks arrays just to skip them, and gives each tensor as GGUFReader does: its
type, its dims in GGUF order, and its bytes in the map as a numpy array (F32/F16/F64 and integer
tensors as values in reversed-dims shape, every other type as bytes in its byte shape), which
`gguf.quants.dequantize` takes.

The format (GGUF v2 and v3, little-endian): magic `GGUF`, u32 version, u64 tensor count, u64
metadata count; metadata as (string key, u32 type, value); tensor infos as (string name, u32 dim
count, u64 dims, u32 type, u64 offset); tensor data from the next multiple of
`general.alignment` (default 32). A string is a u64 length and UTF-8 bytes; an array a u32 item
type, a u64 count and the items.
"""
from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_VALUE_TYPES = {  # tensor types stored as plain values rather than blocks or bytes
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims in GGUF order (fastest first), as GGUFReader gives them
    data: np.ndarray  # a read-only view of the file


class GGUFHeader:
    """`values`: metadata key -> value (None for an array, which is skipped); `types`: key ->
    GGUFValueType; `tensors`: GGUFTensor in file order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        # A plain array over the map: slices of an np.memmap are memmaps, whose per-slice
        # bookkeeping dominates dequantizing (gguf.quants slices every tensor into row groups).
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        self._buf = memoryview(self._map)
        self.values: dict[str, Any] = {}
        self.types: dict[str, GGUFValueType] = {}
        self.tensors: list[GGUFTensor] = []
        self._parse()

    def _unpack(self, fmt: str, pos: int) -> tuple[Any, int]:
        return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)

    def _string(self, pos: int) -> tuple[str, int]:
        size, pos = self._unpack("<Q", pos)
        if pos + size > len(self._buf):
            raise ValueError("a string runs past the end of the file")
        return bytes(self._buf[pos : pos + size]).decode("utf-8"), pos + size

    def _skip_array(self, pos: int) -> int:
        item_type, pos = self._unpack("<I", pos)
        count, pos = self._unpack("<Q", pos)
        item_type = GGUFValueType(item_type)
        if item_type == GGUFValueType.STRING:
            for _ in range(count):
                size = struct.unpack_from("<Q", self._buf, pos)[0]
                pos += 8 + size
        elif item_type == GGUFValueType.ARRAY:
            for _ in range(count):
                pos = self._skip_array(pos)
        else:
            pos += count * struct.calcsize(_SCALARS[item_type])
        if pos > len(self._buf):
            raise ValueError("an array runs past the end of the file")
        return pos

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, pos = self._unpack("<I", 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, pos = self._unpack("<Q", pos)
        kv_count, pos = self._unpack("<Q", pos)
        for _ in range(kv_count):
            key, pos = self._string(pos)
            kind, pos = self._unpack("<I", pos)
            kind = GGUFValueType(kind)
            self.types[key] = kind
            if kind == GGUFValueType.STRING:
                self.values[key], pos = self._string(pos)
            elif kind == GGUFValueType.ARRAY:
                self.values[key], pos = None, self._skip_array(pos)
            else:
                self.values[key], pos = self._unpack(_SCALARS[kind], pos)
        infos = []
        for _ in range(tensor_count):
            name, pos = self._string(pos)
            n_dims, pos = self._unpack("<I", pos)
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", self._buf, pos), dtype=np.uint64)
            pos += 8 * n_dims
            kind, pos = self._unpack("<I", pos)
            offset, pos = self._unpack("<Q", pos)
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        alignment = int(self.values.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("general.alignment must be a power of two")
        start = -(-pos // alignment) * alignment
        names = set()
        for name, dims, kind, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name} is listed twice")
            names.add(name)
            self.tensors.append(GGUFTensor(name, kind, dims, self._data(start + offset, dims, kind)))

    def _data(self, offset: int, dims: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
        n_elems = int(np.prod(dims))
        shape = tuple(int(d) for d in reversed(dims.tolist()))
        dtype = _VALUE_TYPES.get(kind)
        if dtype is not None:
            count, item = n_elems, np.dtype(dtype)
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            count, item = n_elems * type_size // block_size, np.dtype(np.uint8)
            shape = quant_shape_to_byte_shape(shape, kind)
        end = offset + count * item.itemsize
        if end > len(self._map):
            raise ValueError("a tensor runs past the end of the file")
        return self._map[offset:end].view(item).reshape(shape)
