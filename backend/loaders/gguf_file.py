"""A GGUF file's metadata and tensor views, read in one pass over a memory map.

``gguf.GGUFReader`` builds a numpy view per array element: the 151936 tokens and 151387 merges of a Qwen2
vocabulary took it 12 s on the shared 2-core VM, the SmolLM2 file 3 s. The loader needs the scalar and
string keys, the length of the token list and the tensors, so this reader decodes scalars and strings,
decodes numeric arrays with one ``np.frombuffer``, and only counts (walks past) string arrays. Tensor data
are zero-copy read-only views of the map, shaped as ``GGUFReader`` shapes them (what
``gguf.quants.dequantize`` takes): native dtypes for F32/F16/F64/I8..I64, else ``uint8`` rows of
``ne0 / block * type_size`` bytes.

Errors: ``ValueError`` for a file that is not GGUF v2/v3 little-endian, cut short, or with an unknown value
or tensor type (the message says which).

Source followed: the GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), gguf-py
``gguf_reader.py`` (tensor shapes) and ``constants.py`` (``GGML_QUANT_SIZES``).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """A string array's place in the file, not decoded: ``length`` strings from byte ``offset``
    (``GGUFFile.strings`` decodes them)."""

    length: int
    offset: int

    def __len__(self) -> int:
        return self.length


@dataclass
class GGUFTensor:
    """One tensor: ``shape`` in GGUF order (``ne0`` = row length first), ``data`` as ``GGUFReader`` gives it."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    data: np.ndarray


class GGUFFile:
    """``metadata`` (key -> int/float/bool/str, numeric arrays as numpy arrays, string arrays as
    ``StringArray``), ``value_types`` (key -> ``(GGUF value type, array item type or None)``, the spec's
    numbering, e.g. ``(9, 8)`` for an array of strings) and ``tensors`` (in file order) of one GGUF file.

    Raises:
        ValueError: see the module docstring.
    """

    def __init__(self, path: str | Path) -> None:
        import gguf

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        try:
            magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
            if magic != b"GGUF":
                raise ValueError(f"not a GGUF file (starts with {magic!r}, not b'GGUF')")
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version} (2 and 3, little-endian, are read)")
            self._off = 24
            self.metadata: dict[str, object] = {}
            self.value_types: dict[str, tuple[int, int | None]] = {}
            for _ in range(n_kv):
                key = self._string()
                (vtype,) = self._unpack("<I")
                item = struct.unpack_from("<I", buf, self._off)[0] if vtype == _ARRAY else None
                self.value_types[key] = (vtype, item)
                self.metadata[key] = self._value(vtype)
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                (n_dims,) = self._unpack("<I")
                dims = self._unpack(f"<{n_dims}Q")
                type_id, offset = self._unpack("<IQ")
                infos.append((name, dims, type_id, offset))
        except struct.error as exc:
            raise ValueError(f"truncated or corrupt GGUF file: {exc}") from None
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._off // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, type_id, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
            except ValueError:
                raise ValueError(f"tensor '{name}' has an unknown type id {type_id}") from None
            n = int(np.prod(dims, dtype=np.int64))
            shape = tuple(reversed(dims))
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            native = {
                "F32": "<f4",
                "F16": "<f2",
                "F64": "<f8",
                "I8": "i1",
                "I16": "<i2",
                "I32": "<i4",
                "I64": "<i8",
            }
            if qtype.name in native:
                dtype, count = np.dtype(native[qtype.name]), n
            else:
                dtype, count = np.dtype(np.uint8), n * size // block
                shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            at = start + offset
            if at + count * dtype.itemsize > len(buf):
                raise ValueError(
                    f"truncated or corrupt GGUF file: tensor '{name}' ends past the end of the file"
                )
            data = np.frombuffer(buf, dtype=dtype, count=count, offset=at).reshape(shape)
            self.tensors.append(GGUFTensor(name, qtype, tuple(dims), n, data))

    def strings(self, key: str) -> list[str]:
        """The decoded strings of the string array ``key`` (UTF-8, invalid bytes replaced).

        Raises:
            KeyError: no such key. TypeError: not a string array.
        """
        arr = self.metadata[key]
        if not isinstance(arr, StringArray):
            raise TypeError(f"{key} is not an array of strings")
        out, off, buf, unpack = [], arr.offset, self._map, struct.unpack_from
        for _ in range(arr.length):
            (ln,) = unpack("<Q", buf, off)
            out.append(buf[off + 8 : off + 8 + ln].decode("utf-8", errors="replace"))
            off += 8 + ln
        return out

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._map, self._off)
        self._off += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        raw = self._map[self._off : self._off + n]
        if len(raw) != n:
            raise struct.error("string past the end of the file")
        self._off += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> object:
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype])[0]
        if vtype != _ARRAY:
            raise ValueError(f"truncated or corrupt GGUF file: unknown metadata value type {vtype}")
        item, n = self._unpack("<IQ")
        if item == _STRING:
            start = off = self._off
            unpack, end = struct.unpack_from, len(self._map)
            for _ in range(n):
                (ln,) = unpack("<Q", self._map, off)
                off += 8 + ln
                if off > end:
                    raise struct.error("string array past the end of the file")
            self._off = off
            return StringArray(n, start)
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            if self._off + n * dtype.itemsize > len(self._map):
                raise struct.error("array past the end of the file")
            arr = np.frombuffer(self._map, dtype=dtype, count=n, offset=self._off).copy()
            self._off += n * dtype.itemsize
            return arr
        return [self._value(item) for _ in range(n)]  # arrays of arrays: rare, decoded as they come
