"""A fast reader of a GGUF file: its metadata as Python values, its tensors as memory-mapped arrays.

`gguf.GGUFReader` makes a numpy view of every part of every metadata field; for a 49k-token
vocabulary with its merges that is ~300k views and ~5 s per open, paid by the scheduler (for the
tokenizer) and again by every worker (for the weights). This walks the same header with
`struct` in a fraction of a second and takes the type tables from the gguf package, so its
tensors are what GGUFReader's are (same dtype, shape and bytes; tests/ipc/test_gguf_file.py checks
both on the default model). It lives in ipc/ because the service and the workers both read the
model file, and ipc/ is the package both may import.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC,
                            GGMLQuantizationType, GGUFValueType)
from gguf.quants import quant_shape_to_byte_shape

# Scalar value types: struct format (little-endian) and numpy dtype of an array of them.
_SCALARS: dict[GGUFValueType, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")), GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")), GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")), GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")), GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")), GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
_U64 = struct.Struct("<Q")
# Tensor types stored as plain numbers; every other type is blocks of bytes.
_PLAIN_TENSORS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (truncated, corrupt, big-endian)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF order: innermost dimension first, as GGUFReader gives it
    data: np.ndarray  # read-only view of the file: numbers, or uint8 rows of quantized blocks


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise GGUFFormatError(f"the file is empty ({e})") from None
        self._pos = 0
        try:
            self.fields, self.tensors = self._read()
        except GGUFFormatError:
            raise
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            raise GGUFFormatError(f"{type(e).__name__} at byte {self._pos}: {e}") from None

    # -- header -----------------------------------------------------------------------------

    def _read(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        magic, version = self._unpack("<II")
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(f"not a GGUF file (magic {magic:#010x}, expected {GGUF_MAGIC:#010x})")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            what = "a big-endian GGUF file" if swapped in (2, 3) else f"GGUF version {version}"
            raise GGUFFormatError(f"{what} is not supported (little-endian version 2 or 3 is)")
        num_tensors, num_fields = self._unpack("<QQ")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            if key in fields:
                raise GGUFFormatError(f"metadata key '{key}' appears twice")
            fields[key] = self._value(GGUFValueType(self._unpack("<I")[0]))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        tensors, names = [], set()
        for name, dims, kind, offset in infos:
            if name in names:
                raise GGUFFormatError(f"tensor '{name}' appears twice")
            names.add(name)
            tensors.append(self._tensor(name, dims, kind, start + offset))
        return fields, tensors

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._map):
            raise GGUFFormatError(f"a string of {n} bytes runs past the end of the file")
        text = self._map[self._pos:end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item_kind, count = GGUFValueType(self._unpack("<I")[0]), self._unpack("<Q")[0]
            if item_kind in _SCALARS:  # numbers in one piece
                dtype = _SCALARS[item_kind][1]
                items = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return items.tolist()
            if item_kind == GGUFValueType.STRING:
                return self._strings(count)
            return [self._value(item_kind) for _ in range(count)]
        return self._unpack(_SCALARS[kind][0])[0]

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary, its merges) in one tight loop: a third of the
        time of reading them one value at a time."""
        data, pos, size = self._map, self._pos, len(self._map)
        length_at = _U64.unpack_from
        out = []
        for _ in range(count):
            (n,) = length_at(data, pos)
            pos += 8
            if pos + n > size:
                self._pos = pos
                raise GGUFFormatError(f"a string of {n} bytes runs past the end of the file")
            out.append(data[pos:pos + n].decode("utf-8"))
            pos += n
        self._pos = pos
        return out

    def _tensor_info(self) -> tuple[str, list[int], GGMLQuantizationType, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        dims = list(self._unpack(f"<{n_dims}Q"))
        kind = GGMLQuantizationType(self._unpack("<I")[0])
        (offset,) = self._unpack("<Q")
        return name, dims, kind, offset

    def _tensor(self, name: str, dims: list[int], kind: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        n_elements = int(np.prod(dims))
        np_shape = tuple(reversed(dims))
        if kind in _PLAIN_TENSORS:
            dtype, count = np.dtype(_PLAIN_TENSORS[kind]), n_elements
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), n_elements * type_size // block_size
            np_shape = quant_shape_to_byte_shape(np_shape, kind)
        if offset + count * dtype.itemsize > len(self._map):
            raise GGUFFormatError(f"tensor '{name}' runs past the end of the file")
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(np_shape)
        return GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), data)
