"""A GGUF file's metadata and tensor table, read lazily (one place for GGUF header parsing).

gguf.GGUFReader builds a numpy view for every element of every metadata array when it opens
a file: for the default model's 49k-token vocabulary and its merges that is about 4 s, paid
by every engine start. This reader steps over an array (one length per string) and decodes a
value only when it is asked for, so opening a file costs tens of milliseconds. Its tensors
are memory-mapped numpy views with GGUFReader's shapes and dtypes, so the gguf package's
`dequantize` and our block kernels take them as they are.

Only little-endian files (what llama.cpp writes) are read; a malformed or truncated one is a
ValueError naming the file and what is wrong.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import Any

import msgspec
import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct formats of the fixed-size scalars.
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING = 8
_ARRAY = 9
_U64 = struct.Struct("<Q")


class GGUFField(msgspec.Struct, frozen=True):
    """One metadata key/value; `contents()` decodes the value (a list for an array)."""

    name: str
    value_type: int  # GGUF's value type; 9 is an array of `element_type`
    element_type: int | None  # an array's element type
    count: int  # an array's length; 1 for a scalar
    offset: int  # where the value (for an array, its first element) starts in the file
    buffer: Any  # the file's memory map

    def contents(self) -> Any:
        try:
            if self.value_type != _ARRAY:
                return _scalar(self.buffer, self.offset, self.value_type)[0]
            if self.element_type == _STRING:
                return _strings(self.buffer, self.offset, self.count)
            dtype = _NUMPY_TYPES[self.element_type]
            return np.frombuffer(self.buffer, dtype=dtype, count=self.count,
                                 offset=self.offset).tolist()
        except (struct.error, ValueError, KeyError) as exc:
            raise ValueError(f"GGUF metadata {self.name!r} is unreadable: {exc}") from None


class GGUFTensor(msgspec.Struct, frozen=True):
    """A tensor as gguf.GGUFReader describes it: `shape` in ggml's order (innermost first),
    `data` a view in numpy's order (a quantized tensor's rows as bytes)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """Open once, read what you need: `fields` by key, `get_field(key)`, `tensors`."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.getsize(path) < 24:  # numpy cannot map an empty file
            raise ValueError(f"{path} is not a GGUF file (under 24 bytes)")
        self._map = np.memmap(path, mode="r")
        buf = self._map
        try:
            if bytes(buf[:4]) != _MAGIC:
                raise ValueError(f"{path} is not a GGUF file")
            version, self._tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
            if version & 0xFFFF == 0:
                raise ValueError(f"{path} is a big-endian GGUF file; only little-endian "
                                 "files are read")
            if version < 2:
                raise ValueError(f"{path}: GGUF version {version} is not supported")
            self.fields, self._tensor_table = _read_fields(buf, 24, kv_count)
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a well-formed GGUF file ({exc})") from None

    def get_field(self, key: str) -> GGUFField | None:
        return self.fields.get(key)

    @functools.cached_property
    def tensors(self) -> list[GGUFTensor]:
        """The tensor table, with memory-mapped data (the gguf package is needed only here:
        the frontend reads metadata alone)."""
        try:
            return _read_tensors(self._map, self._tensor_table, self._tensor_count,
                                 self._alignment())
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path}: the GGUF tensor table is malformed ({exc})"
                             ) from None

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        alignment = _DEFAULT_ALIGNMENT if field is None else field.contents()
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment!r} is not a power "
                             "of two")
        return alignment


def _read_fields(buf, pos: int, kv_count: int) -> tuple[dict[str, GGUFField], int]:
    fields: dict[str, GGUFField] = {}
    for _ in range(kv_count):
        key, pos = _string(buf, pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if value_type == _ARRAY:
            element_type, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            fields[key] = GGUFField(key, value_type, element_type, count, pos, buf)
            pos = _skip_array(buf, pos, element_type, count)
        else:
            fields[key] = GGUFField(key, value_type, None, 1, pos, buf)
            pos = _scalar(buf, pos, value_type)[1]
    return fields, pos


def _string(buf, pos: int) -> tuple[str, int]:
    (n,) = _U64.unpack_from(buf, pos)
    start = pos + 8
    if start + n > len(buf):
        raise IndexError(f"a string of {n} bytes at {pos} runs past the end of the file")
    return bytes(buf[start:start + n]).decode("utf-8", errors="replace"), start + n


def _strings(buf, pos: int, count: int) -> list[str]:
    out = []
    for _ in range(count):
        text, pos = _string(buf, pos)
        out.append(text)
    return out


def _scalar(buf, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type == _STRING:
        return _string(buf, pos)
    fmt = _SCALAR_FORMATS.get(value_type)
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {value_type}")
    (value,) = struct.unpack_from(fmt, buf, pos)
    return value, pos + struct.calcsize(fmt)


def _skip_array(buf, pos: int, element_type: int, count: int) -> int:
    if element_type == _STRING:
        unpack = _U64.unpack_from
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        return pos
    if element_type == _ARRAY:
        raise ValueError("nested GGUF arrays are not supported")
    fmt = _SCALAR_FORMATS.get(element_type)
    if fmt is None:
        raise ValueError(f"unknown GGUF array element type {element_type}")
    end = pos + count * struct.calcsize(fmt)
    if end > len(buf):
        raise IndexError(f"an array of {count} values at {pos} runs past the end of the file")
    return end


def _read_tensors(buf, pos: int, count: int, alignment: int) -> list[GGUFTensor]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    infos = []
    for _ in range(count):
        name, pos = _string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if n_dims > 8:  # ggml has at most 4; anything far past that is a broken file
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = np.frombuffer(buf, dtype=np.uint64, count=n_dims, offset=pos + 4).copy()
        raw_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, raw_type, offset))
    start = (pos + alignment - 1) // alignment * alignment
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        n_elements = int(np.prod(dims, dtype=np.uint64))
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block_size
        data_offset = start + int(offset)
        if data_offset + n_bytes > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        np_shape = tuple(int(d) for d in reversed(dims.tolist()))
        dtype = _PLAIN_TYPES.get(qtype.name)
        if dtype is None:  # quantized: each row's blocks as bytes
            data = buf[data_offset:data_offset + n_bytes].reshape(
                quant_shape_to_byte_shape(np_shape, qtype))
        else:
            data = np.frombuffer(buf, dtype=dtype, count=n_elements,
                                 offset=data_offset).reshape(np_shape)
        tensors.append(GGUFTensor(name, qtype, dims, n_elements, n_bytes, data_offset, data))
    return tensors


_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}
