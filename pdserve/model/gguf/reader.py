"""gguf's :class:`GGUFReader` with its metadata arrays read in one pass each.

The stock reader keeps every element of every metadata array as its own numpy view of the
mapped file: a 151,936-token vocabulary (tokens, token types and merges) becomes ~750k
``memmap`` objects, seconds of parsing and hundreds of MB held for as long as the file is open
(in the launcher and again in every worker). Here an array's values are decoded straight into a
Python list (strings with :mod:`struct` over the mapped bytes, numbers with one
``numpy.frombuffer``), kept in :attr:`FastGGUFReader.arrays`; scalars and strings, and the tensor
table, are read by gguf's own code unchanged.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

_NUMBER_DTYPES = {
    GGUFValueType.UINT8: "u1",
    GGUFValueType.INT8: "i1",
    GGUFValueType.UINT16: "u2",
    GGUFValueType.INT16: "i2",
    GGUFValueType.UINT32: "u4",
    GGUFValueType.INT32: "i4",
    GGUFValueType.FLOAT32: "f4",
    GGUFValueType.UINT64: "u8",
    GGUFValueType.INT64: "i8",
    GGUFValueType.FLOAT64: "f8",
    GGUFValueType.BOOL: "?",
}


class FastGGUFReader(GGUFReader):
    """A :class:`GGUFReader` whose array-valued metadata is in :attr:`arrays` (key -> list);
    their :attr:`fields` entries carry the types only."""

    arrays: dict[str, list[Any]]

    def _build_fields(self, offs: int, count: int) -> int:
        try:
            return self._read_fields(offs, count)
        except struct.error as e:  # a truncated file: what GGUFFile reports as unreadable
            raise ValueError(f"metadata runs past the end of the file ({e})") from None

    def _read_fields(self, offs: int, count: int) -> int:
        self.arrays = {}
        order = "<" if self.byte_order == "I" else ">"  # "I": the host's (little-endian) order
        buf = memoryview(self.data)  # type: ignore[arg-type]
        for _ in range(int(count)):
            orig_offs = offs
            (key_len,) = struct.unpack_from(order + "Q", buf, offs)
            key = bytes(buf[offs + 8 : offs + 8 + key_len]).decode("utf-8")
            offs += 8 + key_len
            (raw_type,) = struct.unpack_from(order + "I", buf, offs)
            offs += 4
            if raw_type != GGUFValueType.ARRAY:
                # A scalar or a string: gguf's own parts (cheap: a few views).
                size, parts, idxs, types = self._get_field_parts(offs, raw_type)
                self._push_field(ReaderField(orig_offs, key, parts, idxs, types), skip_sum=True)
                offs += size
                continue
            item_type, length = struct.unpack_from(order + "IQ", buf, offs)
            offs += 12
            values, offs = _array(buf, offs, GGUFValueType(item_type), int(length), order)
            self.arrays[key] = values
            types = [GGUFValueType.ARRAY, GGUFValueType(item_type)]
            self._push_field(ReaderField(orig_offs, key, [], [], types), skip_sum=True)
        return offs


def _array(
    buf: memoryview, offs: int, item_type: GGUFValueType, length: int, order: str
) -> tuple[list[Any], int]:
    """The ``length`` values of ``item_type`` at ``offs``, and the offset after them."""
    if item_type == GGUFValueType.STRING:
        values: list[Any] = []
        unpack = struct.Struct(order + "Q").unpack_from
        for _ in range(length):
            (n,) = unpack(buf, offs)
            _check_within(buf, offs + 8 + n)
            values.append(str(buf[offs + 8 : offs + 8 + n], encoding="utf-8"))
            offs += 8 + n
        return values, offs
    dtype = _NUMBER_DTYPES.get(item_type)
    if dtype is None:  # arrays of arrays: no file pdserve reads has them
        raise ValueError(f"GGUF metadata arrays of {item_type.name} are not supported")
    np_dtype = np.dtype(dtype).newbyteorder(order)
    end = offs + np_dtype.itemsize * length
    _check_within(buf, end)
    return np.frombuffer(buf[offs:end], dtype=np_dtype).tolist(), end


def _check_within(buf: memoryview, end: int) -> None:
    if end > len(buf):
        raise ValueError(f"a metadata value ends at byte {end}, past the file's {len(buf)}")
