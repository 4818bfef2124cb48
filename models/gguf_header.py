"""A lazy reader of a GGUF file's header: metadata key-values and tensor infos, no tensor data.

``gguf.GGUFReader`` builds numpy views of every metadata element as it opens a file (seconds
for a 49k vocabulary, ~20 s for Gemma 3's 262k tokens here) and has no lazy mode; llmd's
metadata users (``llmd kv-size``, the warm start) need a dozen scalars, the tensor infos and
the data offset. This reader walks the fixed header layout of the GGUF spec
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, versions 2 and 3, either byte
order) over a memory map: scalars and strings are decoded, arrays are only skipped (numeric
ones in O(1), strings by their lengths) and decoded when ``contents()`` is called, with the
values ``GGUFReader``'s ``ReaderField.contents()`` gives. Standard library only.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import NamedTuple

from llmd.models.errors import GGUFLoadError

#: GGUF value type → struct format of one element (8 = string, 9 = array are handled apart)
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT; ``general.alignment`` overrides it


class HeaderField(NamedTuple):
    """One metadata value: decoded at once (scalars, strings) or on :meth:`contents` (arrays).

    ``count`` is the array's length (None for a scalar); ``header``, ``offset`` and
    ``elem_type`` locate an array's first element.
    """

    value: object
    count: int | None = None
    header: "GGUFHeader | None" = None
    offset: int = 0
    elem_type: int = 0

    def contents(self):
        """The value as ``GGUFReader``'s ``ReaderField.contents()`` returns it (arrays as lists)."""
        if self.count is None:
            return self.value
        return self.header._decode_array(self.offset, self.elem_type, self.count)


class HeaderTensor(NamedTuple):
    """One tensor info: ``shape`` in GGUF order (fastest dimension first, as ``GGUFReader``),
    ``tensor_type`` the GGML type id (an int equal to ``gguf.GGMLQuantizationType``), and
    ``offset`` the absolute byte offset of its data in the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    offset: int


class GGUFHeader:
    """The header of the GGUF file at ``path``.

    Attributes:
        fields: metadata key → :class:`HeaderField` (the ``fields`` ``read_config`` reads).
        tensors: the tensor infos in file order.
        data_offset: bytes from the file start to the (aligned) tensor data; equal to
            ``GGUFReader.data_offset``.
        version: GGUF version (2 or 3).
    Raises:
        GGUFLoadError: missing file, not GGUF, an unsupported version, or a header cut short.
    """

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise GGUFLoadError(f"model file not found: {path}")
        self.path = path
        with open(path, "rb") as f:
            try:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFLoadError(f"{path} is not a readable GGUF file (empty)") from None
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as e:
            raise GGUFLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None

    def _parse(self) -> None:
        buf = self._buf
        if buf[:4] != b"GGUF":
            raise ValueError("bad magic")
        version = struct.unpack_from("<I", buf, 4)[0]
        self._end = "<" if version & 0xFFFF else ">"  # a big-endian file reads as 0x0N000000
        self.version = struct.unpack_from(self._end + "I", buf, 4)[0]
        if self.version not in (2, 3):
            raise ValueError(f"GGUF version {self.version} (llmd reads 2 and 3)")
        n_tensors, n_kv = struct.unpack_from(self._end + "QQ", buf, 8)
        self._u64 = struct.Struct(self._end + "Q")
        self._u32 = struct.Struct(self._end + "I")
        off = 24
        self.fields: dict[str, HeaderField] = {}
        for _ in range(n_kv):
            key, off = self._string(off)
            vtype = self._u32.unpack_from(buf, off)[0]
            field, off = self._value(off + 4, vtype)
            self.fields[key] = field
        self.tensors: list[HeaderTensor] = []
        infos = []
        for _ in range(n_tensors):
            name, off = self._string(off)
            n_dims = self._u32.unpack_from(buf, off)[0]
            shape = struct.unpack_from(f"{self._end}{n_dims}Q", buf, off + 4)
            off += 4 + 8 * n_dims
            ttype, rel = struct.unpack_from(self._end + "IQ", buf, off)
            off += 12
            infos.append((name, shape, ttype, rel))
        align_field = self.fields.get("general.alignment")
        align = int(align_field.value) if align_field is not None else DEFAULT_ALIGNMENT
        self.data_offset = off + (-off % align)
        self.tensors = [HeaderTensor(n, s, t, self.data_offset + r) for n, s, t, r in infos]

    def _string(self, off: int) -> tuple[str, int]:
        n = self._u64.unpack_from(self._buf, off)[0]
        end = off + 8 + n
        if end > len(self._buf):
            raise ValueError(f"string at byte {off} runs past the end of the file")
        return self._buf[off + 8 : end].decode("utf-8"), end

    def _value(self, off: int, vtype: int) -> tuple[HeaderField, int]:
        if vtype == STRING:
            s, off = self._string(off)
            return HeaderField(s), off
        if vtype == ARRAY:
            elem, count = struct.unpack_from(self._end + "IQ", self._buf, off)
            start = off + 12
            return HeaderField(None, count, self, start, elem), self._skip_array(start, elem, count)
        fmt = SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {off}")
        return HeaderField(struct.unpack_from(self._end + fmt, self._buf, off)[0]), off + struct.calcsize(fmt)

    def _skip_array(self, off: int, elem: int, count: int) -> int:
        if elem in SCALAR_FORMATS:
            return off + count * struct.calcsize(SCALAR_FORMATS[elem])
        if elem == STRING:
            unpack, buf = self._u64.unpack_from, self._buf
            for _ in range(count):
                off += 8 + unpack(buf, off)[0]
            if off > len(buf):
                raise ValueError("a string array runs past the end of the file")
            return off
        if elem == ARRAY:
            for _ in range(count):
                sub, n = struct.unpack_from(self._end + "IQ", self._buf, off)
                off = self._skip_array(off + 12, sub, n)
            return off
        raise ValueError(f"unknown GGUF array element type {elem} at byte {off}")

    def _decode_array(self, off: int, elem: int, count: int) -> list:
        if elem in SCALAR_FORMATS:
            return list(struct.unpack_from(f"{self._end}{count}{SCALAR_FORMATS[elem]}", self._buf, off))
        out = []
        for _ in range(count):
            if elem == STRING:
                s, off = self._string(off)
                out.append(s)
            else:  # nested arrays flatten, as ReaderField.contents() gives them
                sub, n = struct.unpack_from(self._end + "IQ", self._buf, off)
                out.extend(self._decode_array(off + 12, sub, n))
                off = self._skip_array(off + 12, sub, n)
        return out


def read_header(path: str) -> GGUFHeader:
    """The :class:`GGUFHeader` of ``path``. Raises GGUFLoadError (see the class)."""
    return GGUFHeader(path)
