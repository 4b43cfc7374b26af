"""A GGUF file (v2/v3) read from a memory map: metadata parsed in one pass, tensors as views of the map.

``gguf.GGUFReader`` builds numpy views for every part of every value, a few per vocabulary string (seconds for
a 262k-token vocabulary). Here a string array becomes a list of ``str`` in one loop over the bytes, a numeric
array one numpy array, and a tensor's ``data`` a zero-copy view of the mapped file laid out as GGUFReader lays
it out (quantised types as ``(rows, bytes per row)`` uint8, plain types typed with ggml's dimensions reversed).
The map is read-only (``PROT_READ``, like llama.cpp's): untouched pages cost no memory, and a private writable
map would be charged in full against the kernel's commit limit. ``torch_view`` wraps a view without a copy.
"""

from __future__ import annotations

import mmap
import struct
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from kvserve.errors import ModelLoadError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
# Little-endian struct formats of the fixed-size value types (GGUF's own byte order on every host we run on).
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_DTYPES = {kind: np.dtype(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
# Tensor types GGUFReader gives as typed arrays; every other type is raw block bytes.
_PLAIN_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from


class _Corrupt(Exception):
    """What is wrong with the file, raised inside the parser and reported with its path."""


class GGUFField(NamedTuple):
    """One metadata key: ``types`` as GGUFReader lists them ([ARRAY, item type] for an array)."""

    name: str
    types: list[GGUFValueType]
    value: object  # int / float / bool / str, a list of str (or of nested arrays), or a numpy array

    def contents(self) -> object:
        """The value: a Python scalar or ``str``, a new list for a string array, a numpy array for a numeric one."""
        return list(self.value) if isinstance(self.value, list) else self.value


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64, ggml's order (innermost dimension first)
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a read-only view of the memory map


class GGUFFile:
    """A GGUF file's metadata (``fields``) and tensors (``tensors``), the tensors viewing a memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file cannot be mapped
                raise ModelLoadError(f"{self.path} is truncated or corrupt: {exc}") from exc
        self.fields: dict[str, GGUFField] = {}
        self.tensors: list[GGUFTensor] = []
        try:
            self._parse()
        except (_Corrupt, struct.error, OverflowError) as exc:  # struct.error: a read past the end
            detail = str(exc) if isinstance(exc, _Corrupt) else f"{type(exc).__name__}: {exc}"
            raise ModelLoadError(f"{self.path} is truncated or corrupt: {detail}") from exc

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ModelLoadError(
                f"{self.path} is not a GGUF file (starts with {bytes(buf[:4])!r}, expected {_MAGIC!r})"
            )
        (version,) = _U32(buf, 4)
        if version not in _VERSIONS:
            if version & 0xFFFF == 0:
                raise ModelLoadError(f"{self.path} is a big-endian GGUF file, which kvserve does not read")
            raise ModelLoadError(f"{self.path} is GGUF version {version}; kvserve reads versions 2 and 3")
        tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        self.fields["GGUF.version"] = GGUFField("GGUF.version", [GGUFValueType.UINT32], version)
        self.fields["GGUF.tensor_count"] = GGUFField("GGUF.tensor_count", [GGUFValueType.UINT64], tensor_count)
        self.fields["GGUF.kv_count"] = GGUFField("GGUF.kv_count", [GGUFValueType.UINT64], kv_count)
        offset = 24
        for _ in range(kv_count):
            key, offset = self._string(offset)
            if key in self.fields:
                raise _Corrupt(f"metadata key {key!r} appears twice")
            try:
                self.fields[key], offset = self._value(key, _U32(buf, offset)[0], offset + 4)
            except (struct.error, UnicodeDecodeError) as exc:
                raise _Corrupt(f"metadata key {key!r} at byte {offset}: {type(exc).__name__}: {exc}") from exc
        infos = []
        for _ in range(tensor_count):
            info, offset = self._tensor_info(offset)
            infos.append(info)
        data_start = _align(offset, self._alignment())
        names = set()
        for name, dims, raw_type, relative in infos:
            if name in names:
                raise _Corrupt(f"tensor {name!r} appears twice")
            names.add(name)
            self.tensors.append(self._tensor(name, dims, raw_type, data_start + relative))

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = _U64(self._map, offset)
        end = offset + 8 + length
        if end > len(self._map):
            raise _Corrupt(f"a string at byte {offset} runs past the end of the file ({len(self._map)} bytes)")
        try:
            return str(self._map[offset + 8 : end], "utf-8"), end
        except UnicodeDecodeError as exc:
            raise _Corrupt(f"the string at byte {offset} is not UTF-8: {exc}") from None

    def _value(self, key: str, raw_kind: int, offset: int) -> tuple[GGUFField, int]:
        kind = _value_type(raw_kind, key)
        if kind == GGUFValueType.ARRAY:
            (raw_item,) = _U32(self._map, offset)
            (count,) = _U64(self._map, offset + 4)
            item = _value_type(raw_item, key)
            value, end = self._array(key, item, count, offset + 12)
            return GGUFField(key, [kind, item], value), end
        if kind == GGUFValueType.STRING:
            value, end = self._string(offset)
            return GGUFField(key, [kind], value), end
        fmt = _SCALAR_FORMATS[kind]
        (value,) = struct.unpack_from(fmt, self._map, offset)
        return GGUFField(key, [kind], value), offset + struct.calcsize(fmt)

    def _array(self, key: str, item: GGUFValueType, count: int, offset: int) -> tuple[object, int]:
        remaining = len(self._map) - offset
        if item in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[item]
            if count * dtype.itemsize > remaining:
                raise _Corrupt(f"metadata array {key!r} ({count} items) runs past the end of the file")
            array = np.frombuffer(self._map, dtype, count, offset)
            return array, offset + array.nbytes
        if count * 8 > remaining:  # every string or array has at least an 8-byte length
            raise _Corrupt(f"metadata array {key!r} ({count} items) runs past the end of the file")
        if item == GGUFValueType.STRING:
            return _strings(self._map, offset, count)
        values = []
        for _ in range(count):  # nested arrays: rare and short
            (raw_inner,) = _U32(self._map, offset)
            (inner_count,) = _U64(self._map, offset + 4)
            inner, offset = self._array(key, _value_type(raw_inner, key), inner_count, offset + 12)
            values.append(inner)
        return values, offset

    def _tensor_info(self, offset: int) -> tuple[tuple[str, np.ndarray, int, int], int]:
        name, offset = self._string(offset)
        (n_dims,) = _U32(self._map, offset)
        if n_dims > 8:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        dims = np.array(struct.unpack_from(f"<{n_dims}Q", self._map, offset + 4), dtype=np.uint64)
        offset += 4 + 8 * n_dims
        raw_type, relative = struct.unpack_from("<IQ", self._map, offset)
        return (name, dims, raw_type, relative), offset + 12

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return GGUF_DEFAULT_ALIGNMENT
        if field.types != [GGUFValueType.UINT32]:
            raise _Corrupt(f"general.alignment is {field.types[0].name}, not UINT32")
        alignment = int(field.value)
        if alignment == 0 or alignment & (alignment - 1):
            raise _Corrupt(f"general.alignment {alignment} is not a power of two")
        return alignment

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, offset: int) -> GGUFTensor:
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise _Corrupt(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        n_elements = int(np.prod(dims, dtype=np.uint64))
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if n_elements % block or dims.size and int(dims[0]) % block:
            raise _Corrupt(f"tensor {name!r} of shape {dims.tolist()} is not whole {kind.name} blocks")
        n_bytes = n_elements // block * block_bytes
        if offset + n_bytes > len(self._map):
            raise _Corrupt(
                f"tensor {name!r} lies past the end of the file (bytes {offset}..{offset + n_bytes} of "
                f"{len(self._map)})"
            )
        shape = tuple(reversed(dims.tolist()))
        raw = np.frombuffer(self._map, np.uint8, n_bytes, offset)
        plain = _PLAIN_DTYPES.get(kind)
        data = raw.view(plain).reshape(shape) if plain else raw.reshape(quant_shape_to_byte_shape(shape, kind))
        return GGUFTensor(name, kind, dims, n_elements, n_bytes, offset, data)


def _strings(buf: mmap.mmap, offset: int, count: int) -> tuple[list[str], int]:
    """``count`` GGUF strings (u64 length + UTF-8 bytes) from ``offset``: one tight loop, no per-item views."""
    out: list[str] = []
    append, unpack = out.append, _U64
    for _ in range(count):
        start = offset + 8
        offset = start + unpack(buf, offset)[0]
        append(str(buf[start:offset], "utf-8"))
    if offset > len(buf):  # offsets only grow, so one check finds a string cut short by the end of the file
        raise _Corrupt(f"a string array runs past the end of the file ({len(buf)} bytes)")
    return out, offset


def _value_type(raw: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise _Corrupt(f"metadata key {key!r} has unknown value type {raw}") from None


def _align(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


def torch_view(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (a read-only map): torch's warning that it cannot mark the tensor
    read-only is silenced; writing to it would fault, and nothing here writes to weights."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)
