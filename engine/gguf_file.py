"""GGUF file reading: the header (metadata and tensor table), checked before MLX reads it.

A GGUF file (llama.cpp's format, version 2 or 3, little-endian) is a header of typed
key/value metadata and a table of tensors (name, shape, ggml type, offset), then the
aligned tensor data. `read_header` parses all of it with bounds checks and
`check_types` looks at the tensor types, so that a truncated or corrupt file, or a tensor
type tqserve does not load, is refused with one line naming the problem before `mx.load`
(whose reader maps the file and trusts it) runs.

Tensor types loaded (`SUPPORTED_TYPES`): F32, F16, BF16 and the block quantizations that
MLX reads into its own affine layout, Q4_0, Q4_1 (4 bits) and Q8_0 (8 bits), 32 weights
per block. Other ggml types (the K-quants, IQ types, Q5_x ...) are refused by name.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# ggml type id -> name, for the error that names a type tqserve does not load
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
# type id -> (weights per block, bytes per block, affine bits or 0 for a float type)
SUPPORTED_TYPES = {0: (1, 4, 0), 1: (1, 2, 0), 30: (1, 2, 0),
                   2: (32, 18, 4), 3: (32, 20, 4), 8: (32, 34, 8)}
QUANT_GROUP_SIZE = 32  # MLX's affine layout of Q4_0 / Q4_1 / Q8_0 (one group per block)
# metadata value type id -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}


class GGUFError(ValueError):
    """The file is not a GGUF file tqserve can load (the message names why)."""


@attrs.frozen(kw_only=True)
class TensorInfo:
    """One entry of the tensor table: shape as GGUF writes it (fastest axis first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, f"type {self.ggml_type}")

    @property
    def bits(self) -> int:
        """Affine bits of a quantized type (4 or 8); 0 for a float type."""
        return SUPPORTED_TYPES[self.ggml_type][2]


@attrs.frozen(kw_only=True)
class GGUFHeader:
    """What the header says: metadata by key and the tensor table by name."""

    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


class _Reader:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"the header ends early at byte {self.pos} (file truncated?)")
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.scalar("<Q")))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"a header string before byte {self.pos} is not UTF-8") from None

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise GGUFError(f"unknown metadata value type {kind} at byte {self.pos}")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype).copy()
        if item == 8:
            return [self.string() for _ in range(count)]
        raise GGUFError(f"unsupported metadata array of type {item} at byte {self.pos}")


def _tensor(r: _Reader) -> TensorInfo:
    name = r.string()
    ndim = r.scalar("<I")
    if not 1 <= ndim <= 4:
        raise GGUFError(f"tensor {name!r} has {ndim} dimensions")
    shape = tuple(r.scalar("<Q") for _ in range(ndim))
    return TensorInfo(name=name, shape=shape, ggml_type=r.scalar("<I"), offset=r.scalar("<Q"))


def check_types(header: GGUFHeader) -> None:
    """Refuse the first tensor whose ggml type tqserve does not load."""
    for t in header.tensors.values():
        if t.ggml_type not in SUPPORTED_TYPES:
            raise GGUFError(f"tensor {t.name!r} has ggml type {t.type_name}; tqserve loads "
                            f"F32, F16, BF16, Q4_0, Q4_1 and Q8_0 weights")


def _check_extent(t: TensorInfo, data_bytes: int) -> None:
    if t.offset > data_bytes:
        raise GGUFError(f"tensor {t.name!r} starts past the end of the file (truncated)")
    if t.ggml_type not in SUPPORTED_TYPES:
        return  # size unknown here; check_types refuses the type
    block, block_bytes, _ = SUPPORTED_TYPES[t.ggml_type]
    if t.shape[0] % block:
        raise GGUFError(f"tensor {t.name!r}: row of {t.shape[0]} is not a whole number of "
                        f"{t.type_name} blocks")
    size = int(np.prod(t.shape, dtype=np.int64)) // block * block_bytes
    if t.offset + size > data_bytes:
        raise GGUFError(f"tensor {t.name!r} ends past the end of the file (truncated: "
                        f"{t.offset + size - data_bytes} bytes missing)")


def read_header(path: Path) -> GGUFHeader:
    """Parse and check a GGUF file's header and tensor table (GGUFError on any fault)."""
    with path.open("rb") as f:
        size = path.stat().st_size
        if size < 24:
            raise GGUFError(f"{size} bytes is too short for a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(_Reader(buf), size)
            except (struct.error, OverflowError, MemoryError, ValueError) as exc:
                if isinstance(exc, GGUFError):
                    raise
                raise GGUFError(f"corrupt header: {exc}") from None


def _parse(r: _Reader, size: int) -> GGUFHeader:
    if bytes(r.take(4)) != MAGIC:
        raise GGUFError("not a GGUF file (no GGUF magic)")
    version = r.scalar("<I")
    if version not in VERSIONS:
        raise GGUFError(f"GGUF version {version}; tqserve reads versions 2 and 3")
    num_tensors, num_kv = r.scalar("<Q"), r.scalar("<Q")
    if num_tensors > size // 24 or num_kv > size // 12:
        raise GGUFError(f"header claims {num_tensors} tensors and {num_kv} keys (corrupt)")
    metadata = {}
    for _ in range(num_kv):
        key = r.string()
        metadata[key] = r.value(r.scalar("<I"))
    tensors = [_tensor(r) for _ in range(num_tensors)]
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if align <= 0:
        raise GGUFError(f"general.alignment {align} is not positive")
    start = -(-r.pos // align) * align
    for t in tensors:
        _check_extent(t, size - start)
    return GGUFHeader(version=version, metadata=metadata, tensors={t.name: t for t in tensors})
