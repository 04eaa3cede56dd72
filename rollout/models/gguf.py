"""Read the header of a GGUF file: its metadata and tensor infos, never the tensor data.

Written from the GGUF specification (ggml's docs/gguf.md), so planning needs neither the `gguf`
package nor torch. The layout: magic b"GGUF", uint32 version (2 or 3), uint64 tensor count,
uint64 metadata count, the metadata key/values, then one info per tensor (name, dimensions,
ggml type, data offset). All integers are little-endian, unless the whole file is big-endian.

Errors (not a GGUF file, a version we cannot read, a truncated or corrupt header) are raised as
ValueError with a message that says which; the planner turns them into an Issue.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from rollout.files import open_binary

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

KEEP_ARRAY_ITEMS = 256
"""Arrays longer than this (token lists, merges) are skipped over; only their length is kept."""

# Metadata value types (gguf_type) and their struct formats; 8 and 9 are strings and arrays.
_SCALAR_FORMATS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING = 8
_ARRAY = 9

# Bounds no real header comes near; a larger value means the bytes are not what we think they are,
# and reading on would allocate gigabytes.
_MAX_STRING_BYTES = 1 << 26
_MAX_DIMS = 8
_SKIP_CHUNK = 1 << 20

# general.file_type (llama_ftype): the prevailing quantization of the file's weights.
_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    4: "Q4_1_SOME_F16",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    33: "Q4_0_4_4",
    34: "Q4_0_4_8",
    35: "Q4_0_8_8",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array. `values` is None when the array was longer than KEEP_ARRAY_ITEMS."""

    item_type: int
    length: int
    values: tuple[Any, ...] | None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    ggml_type: int
    offset: int  # from the start of the tensor data section

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]

    @property
    def num_parameters(self) -> int:
        return sum(tensor.num_elements for tensor in self.tensors)


def file_type_name(code: int) -> str:
    """The name llama.cpp gives a general.file_type value, e.g. 3 -> 'Q4_1'."""
    return _FILE_TYPES.get(code, f"file_type {code}")


def read_gguf_header(location: str | Path) -> GGUFHeader:
    """Read the header of a local GGUF file or fsspec URL."""
    with open_binary(location) as handle:
        return parse_gguf_header(handle)


def parse_gguf_header(handle: BinaryIO) -> GGUFHeader:
    """Parse a GGUF header from a binary stream positioned at the start of the file."""
    magic = handle.read(4)
    if magic != MAGIC:
        raise ValueError(f"not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    reader = _Reader(handle)
    version = reader.version()
    tensor_count = reader.scalar("Q")
    kv_count = reader.scalar("Q")
    metadata = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("I"))
    tensors = tuple(reader.tensor_info() for _ in range(tensor_count))
    return GGUFHeader(version=version, metadata=metadata, tensors=tensors)


class _Reader:
    """Sequential reads from the stream, with the byte order and offset needed for messages."""

    def __init__(self, handle: BinaryIO):
        self._handle = handle
        self._order = "<"
        self._offset = 4  # after the magic

    def version(self) -> int:
        raw = self._take(4)
        version = struct.unpack("<I", raw)[0]
        if version not in SUPPORTED_VERSIONS and struct.unpack(">I", raw)[0] in SUPPORTED_VERSIONS:
            # A big-endian file: the version reads byte-swapped, and so will everything after it.
            self._order = ">"
            version = struct.unpack(">I", raw)[0]
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"GGUF version {version} is not supported (supported: 2 and 3); "
                "re-convert the model with a current llama.cpp"
            )
        return version

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(self._order + fmt, self._take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self._take(self._string_length()).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self._array()
        raise ValueError(
            f"corrupt GGUF header: unknown value type {value_type} at byte {self._offset}"
        )

    def tensor_info(self) -> TensorInfo:
        name = self.string()
        n_dims = self.scalar("I")
        if n_dims > _MAX_DIMS:
            raise ValueError(f"corrupt GGUF header: tensor {name!r} claims {n_dims} dimensions")
        shape = tuple(self.scalar("Q") for _ in range(n_dims))
        return TensorInfo(
            name=name, shape=shape, ggml_type=self.scalar("I"), offset=self.scalar("Q")
        )

    def _array(self) -> GGUFArray:
        item_type = self.scalar("I")
        length = self.scalar("Q")
        if length <= KEEP_ARRAY_ITEMS:
            values = tuple(self.value(item_type) for _ in range(length))
            return GGUFArray(item_type, length, values)
        if item_type in _SCALAR_FORMATS:
            self._skip(length * struct.calcsize(_SCALAR_FORMATS[item_type]))
        else:
            for _ in range(length):
                self._skip_value(item_type)
        return GGUFArray(item_type, length, None)

    def _skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            self._skip(self._string_length())
        else:
            self.value(value_type)

    def _string_length(self) -> int:
        length = self.scalar("Q")
        if length > _MAX_STRING_BYTES:
            raise ValueError(
                f"corrupt GGUF header: a string at byte {self._offset - 8} claims {length} bytes"
            )
        return length

    def _skip(self, size: int) -> None:
        while size > 0:
            size -= len(self._take(min(size, _SKIP_CHUNK)))

    def _take(self, size: int) -> bytes:
        data = self._handle.read(size)
        if len(data) < size:
            raise ValueError(
                f"truncated GGUF file: it ends at byte {self._offset + len(data)}, inside the "
                "header (was the download interrupted?)"
            )
        self._offset += size
        return data
