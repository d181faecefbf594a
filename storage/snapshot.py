"""The snapshot file format: one immutable KV-cache snapshot per file.

Layout (all integers little-endian)::

    MAGIC (8 bytes) | u32 header length | header (msgpack map) | blake2b-16(header)
    | plane 0 (zstd) | plane 1 (zstd) | ...

The header names every plane with its shape, dtype, raw and compressed lengths and a
blake2b-16 checksum of its compressed bytes, so a reader checks each byte of the file before
trusting it. Checksums are `hashlib.blake2b(digest_size=16)`: it is in the standard library
(no new dependency), faster than SHA-256 in CPython, and 128 bits is ample to catch
corruption. Any bad byte surfaces as `SnapshotError` and nothing else.

Declared sizes are untrusted: `check_sizes` compares them with the real file size, a
per-plane cap and a compression-ratio bound, so a header can never make a reader allocate
more than a bounded multiple of the file's own size (readers call it before loading planes).

Format versions: 2 is written. 1 lacks `minimum_reusable_offset`; a version-1 header reads
back with its stored `offset` as that bound.
"""

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import attrs
import msgpack
import zstandard

# High bit first catches 7-bit transports; the trailing newline catches line-ending rewrites.
MAGIC = b"\x89TQSNAP\n"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
CACHE_KINDS = ("kv", "rotating", "affine", "turboquant")
CHECKSUM_BYTES = 16
# A header holds token ids (at most ~5 bytes each in msgpack): 64 MiB is ~10M tokens.
MAX_HEADER_BYTES = 64 << 20
DTYPE_ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8,
}
MAX_TOKEN_ID = 2**32 - 1
# One plane's raw bytes: 4 GiB is ~ a 1M-token context of a 8-KV-head, 128-dim fp32 layer.
MAX_PLANE_BYTES = 1 << 32
# zstd's format bound: a block decodes to at most 128 KiB and costs at least 4 bytes (3-byte
# block header + 1 RLE byte), so no real plane exceeds this ratio; one that claims more is a
# forged size. (Real KV planes gain a few x at most.)
MAX_COMPRESSION_RATIO = 32768
RATIO_SLACK_BYTES = 1 << 17
_PREFIX = struct.Struct("<8sI")
_HEADER_FIELDS_V1 = (
    "format_version", "cache_kind", "k_bits", "v_bits", "head_dim", "rotation_id",
    "model_fingerprint", "namespace", "token_ids", "offset", "planes", "created_ns", "extra",
)
_HEADER_FIELDS = {1: frozenset(_HEADER_FIELDS_V1),
                  2: frozenset(_HEADER_FIELDS_V1 + ("minimum_reusable_offset",))}
_PLANE_FIELDS = frozenset(("name", "shape", "dtype", "raw_len", "compressed_len", "checksum"))


class SnapshotError(Exception):
    """A snapshot's bytes are not a valid snapshot; `reason` says what is wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@attrs.frozen(kw_only=True)
class PlaneSpec:
    """One stored array: its name, shape, dtype and where its compressed bytes end."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    raw_len: int
    compressed_len: int
    checksum: bytes


@attrs.frozen(kw_only=True)
class SnapshotHeader:
    """Everything about a snapshot except the plane bytes."""

    format_version: int
    cache_kind: str
    k_bits: int | None
    v_bits: int | None
    head_dim: int
    rotation_id: str | None
    model_fingerprint: str
    namespace: str
    token_ids: tuple[int, ...]
    offset: int
    minimum_reusable_offset: int
    planes: tuple[PlaneSpec, ...]
    created_ns: int
    extra: dict[str, int | str | float] = attrs.field(factory=dict)


class Plane(NamedTuple):
    """A decoded plane: raw bytes plus the metadata to rebuild the array."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str


def checksum(data: bytes | memoryview) -> bytes:
    """The format's checksum: blake2b with a 16-byte digest."""
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest()


def encode_snapshot(
    *,
    cache_kind: str,
    k_bits: int | None,
    v_bits: int | None,
    head_dim: int,
    rotation_id: str | None,
    model_fingerprint: str,
    namespace: str,
    token_ids: Sequence[int],
    offset: int,
    minimum_reusable_offset: int,
    created_ns: int,
    planes: Iterable[tuple[str, bytes, Sequence[int], str]],
    extra: Mapping[str, int | str | float] | None = None,
    level: int = 3,
) -> bytes:
    """Encode a version-2 snapshot from (name, raw bytes, shape, dtype) planes.

    ValueError if any field or plane is invalid: what is written always reads back.
    """
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    specs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, data, shape, dtype in planes:
        blob = compressor.compress(data)
        blobs.append(blob)
        specs.append({"name": name, "shape": list(shape), "dtype": dtype, "raw_len": len(data),
                      "compressed_len": len(blob), "checksum": checksum(blob)})
    fields = {
        "format_version": FORMAT_VERSION, "cache_kind": cache_kind, "k_bits": k_bits,
        "v_bits": v_bits, "head_dim": head_dim, "rotation_id": rotation_id,
        "model_fingerprint": model_fingerprint, "namespace": namespace,
        "token_ids": list(token_ids), "offset": offset,
        "minimum_reusable_offset": minimum_reusable_offset, "planes": specs,
        "created_ns": created_ns, "extra": dict(extra or {}),
    }
    try:
        _header_from_dict(fields)
    except SnapshotError as exc:
        raise ValueError(exc.reason) from None
    try:
        header_bytes = msgpack.packb(fields, use_bin_type=True)
    except OverflowError as exc:
        raise ValueError(f"header integer out of range: {exc}") from None
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header_bytes)} bytes exceeds {MAX_HEADER_BYTES}")
    return b"".join([_PREFIX.pack(MAGIC, len(header_bytes)), header_bytes,
                     checksum(header_bytes), *blobs])


def decode_header(source: bytes | memoryview | BinaryIO) -> SnapshotHeader:
    """Verify and decode the header of a snapshot held in a buffer or an open binary file."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _split_header(memoryview(source))[0]
    prefix = source.read(_PREFIX.size)
    header_len = _header_length(memoryview(prefix))
    return _split_header(memoryview(prefix + source.read(header_len + CHECKSUM_BYTES)))[0]


def read_header(file: BinaryIO, file_size: int) -> tuple[SnapshotHeader, int]:
    """Read and verify only the header of an open snapshot file of `file_size` bytes.

    Returns the header and the bytes read (where the first plane starts). Reads nothing
    beyond the header, and never more than the file holds.
    """
    prefix = file.read(_PREFIX.size)
    header_len = _header_length(memoryview(prefix))
    rest = _PREFIX.size + header_len + CHECKSUM_BYTES
    if rest > file_size:
        raise SnapshotError(f"header of {header_len} bytes does not fit a {file_size}-byte file")
    data = prefix + file.read(rest - _PREFIX.size)
    header, end = _split_header(memoryview(data))
    return header, end


def check_sizes(header: SnapshotHeader, header_end: int, file_size: int) -> None:
    """SnapshotError unless the planes' declared sizes fit the real file (see module doc)."""
    declared = header_end + sum(spec.compressed_len for spec in header.planes)
    if declared != file_size:
        raise SnapshotError(f"file is {file_size} bytes, its header declares {declared}")
    _check_plane_caps(header)


def _check_plane_caps(header: SnapshotHeader) -> None:
    for spec in header.planes:
        if spec.raw_len > MAX_PLANE_BYTES:
            raise SnapshotError(f"plane {spec.name} declares {spec.raw_len} bytes, over the "
                                f"cap of {MAX_PLANE_BYTES}")
        if spec.raw_len > spec.compressed_len * MAX_COMPRESSION_RATIO + RATIO_SLACK_BYTES:
            raise SnapshotError(f"plane {spec.name} declares {spec.raw_len} bytes from "
                                f"{spec.compressed_len} compressed (ratio over "
                                f"{MAX_COMPRESSION_RATIO})")


def decode_snapshot(buf: bytes | memoryview) -> tuple[SnapshotHeader, dict[str, Plane]]:
    """Verify every byte of a whole snapshot and return its header and decoded planes."""
    view = memoryview(buf)
    header, position = _split_header(view)
    expected_end = position + sum(spec.compressed_len for spec in header.planes)
    if len(view) > expected_end:
        raise SnapshotError(f"{len(view) - expected_end} trailing bytes after the last plane")
    _check_plane_caps(header)
    decompressor = zstandard.ZstdDecompressor()
    planes: dict[str, Plane] = {}
    for spec in header.planes:
        blob = view[position:position + spec.compressed_len]
        position += spec.compressed_len
        if len(blob) < spec.compressed_len:
            raise SnapshotError(f"truncated plane {spec.name}")
        if checksum(blob) != spec.checksum:
            raise SnapshotError(f"checksum mismatch in plane {spec.name}")
        planes[spec.name] = Plane(_decompress(decompressor, blob, spec), spec.shape, spec.dtype)
    return header, planes


def read_snapshot(path: str | Path) -> tuple[SnapshotHeader, dict[str, Plane]]:
    """Read and fully verify a snapshot file. OSError if it cannot be read."""
    return decode_snapshot(Path(path).read_bytes())


def _decompress(decompressor: zstandard.ZstdDecompressor, blob: memoryview,
                spec: PlaneSpec) -> bytes:
    # A frame that states its size is decompressed to that size whatever max_output_size says,
    # so the stated size is checked first.
    try:
        declared = zstandard.frame_content_size(blob)
        if declared not in (-1, spec.raw_len):
            raise SnapshotError(
                f"plane {spec.name} declares {declared} bytes, expected {spec.raw_len}")
        data = decompressor.decompress(blob, max_output_size=spec.raw_len)
    except zstandard.ZstdError as exc:
        raise SnapshotError(f"cannot decompress plane {spec.name}: {exc}") from None
    if len(data) != spec.raw_len:
        raise SnapshotError(
            f"plane {spec.name} decompressed to {len(data)} bytes, expected {spec.raw_len}")
    return data


def _header_length(view: memoryview) -> int:
    if len(view) < _PREFIX.size:
        raise SnapshotError("truncated prefix")
    magic, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise SnapshotError("bad magic")
    if header_len > MAX_HEADER_BYTES:
        raise SnapshotError(f"header length {header_len} exceeds {MAX_HEADER_BYTES}")
    return header_len


def _split_header(view: memoryview) -> tuple[SnapshotHeader, int]:
    end = _PREFIX.size + _header_length(view)
    if len(view) < end + CHECKSUM_BYTES:
        raise SnapshotError("truncated header")
    header_bytes = view[_PREFIX.size:end]
    if checksum(header_bytes) != bytes(view[end:end + CHECKSUM_BYTES]):
        raise SnapshotError("header checksum mismatch")
    try:
        fields = msgpack.unpackb(header_bytes, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise SnapshotError(f"undecodable header: {exc}") from None
    return _header_from_dict(fields), end + CHECKSUM_BYTES


def _is_int(value: object, low: int = 0, high: int | None = None) -> bool:
    return type(value) is int and value >= low and (high is None or value <= high)


def _is_str(value: object) -> bool:
    return type(value) is str


def _is_optional(check: Any) -> Any:
    return lambda value: value is None or check(value)


def _is_int_list(value: object, high: int | None = None) -> bool:
    return (isinstance(value, (list, tuple)) and type(value) in (list, tuple)
            and all(_is_int(item, 0, high) for item in value))


def _is_scalar_map(value: object) -> bool:
    return type(value) is dict and all(
        _is_str(key) and type(item) in (int, str, float) for key, item in value.items())


_FIELD_CHECKS: dict[str, Any] = {
    "format_version": lambda value: value in SUPPORTED_VERSIONS and _is_int(value),
    "cache_kind": lambda value: value in CACHE_KINDS and _is_str(value),
    "k_bits": _is_optional(lambda value: _is_int(value, 1, 16)),
    "v_bits": _is_optional(lambda value: _is_int(value, 1, 16)),
    "head_dim": lambda value: _is_int(value, 1),
    "rotation_id": _is_optional(_is_str),
    "model_fingerprint": _is_str,
    "namespace": _is_str,
    "token_ids": lambda value: _is_int_list(value, MAX_TOKEN_ID),
    "offset": _is_int,
    "minimum_reusable_offset": _is_int,
    "planes": lambda value: type(value) in (list, tuple),
    "created_ns": _is_int,
    "extra": _is_scalar_map,
}
_PLANE_CHECKS: dict[str, Any] = {
    "name": lambda value: _is_str(value) and value != "",
    "shape": _is_int_list,
    "dtype": lambda value: _is_str(value) and value in DTYPE_ITEMSIZE,
    "raw_len": _is_int,
    "compressed_len": _is_int,
    "checksum": lambda value: type(value) is bytes and len(value) == CHECKSUM_BYTES,
}


def _check_fields(fields: object, expected: frozenset[str], checks: dict[str, Any],
                  what: str) -> dict[str, Any]:
    if type(fields) is not dict:
        raise SnapshotError(f"{what} is not a map")
    if fields.keys() != expected:
        raise SnapshotError(f"{what} fields differ: missing {sorted(expected - fields.keys())}, "
                            f"unknown {sorted(fields.keys() - expected)}")
    for name, value in fields.items():
        if not checks[name](value):
            raise SnapshotError(f"{what} field {name} is invalid: {value!r:.80}")
    return fields


def _plane_from_dict(fields: object) -> PlaneSpec:
    plane = _check_fields(fields, _PLANE_FIELDS, _PLANE_CHECKS, "plane")
    shape = tuple(plane["shape"])
    expected_len = math.prod(shape) * DTYPE_ITEMSIZE[plane["dtype"]]
    if plane["raw_len"] != expected_len:
        raise SnapshotError(f"plane {plane['name']} raw_len {plane['raw_len']} != {expected_len} "
                            f"for shape {shape} {plane['dtype']}")
    return PlaneSpec(name=plane["name"], shape=shape, dtype=plane["dtype"],
                     raw_len=plane["raw_len"], compressed_len=plane["compressed_len"],
                     checksum=plane["checksum"])


def _header_from_dict(fields: object) -> SnapshotHeader:
    if type(fields) is not dict:
        raise SnapshotError("header is not a map")
    version = fields.get("format_version")
    if not isinstance(version, int) or not _FIELD_CHECKS["format_version"](version):
        raise SnapshotError(f"unsupported format version {version!r:.40}")
    header = _check_fields(fields, _HEADER_FIELDS[version], _FIELD_CHECKS, "header")
    planes = tuple(_plane_from_dict(plane) for plane in header["planes"])
    if len({plane.name for plane in planes}) != len(planes):
        raise SnapshotError("duplicate plane names")
    minimum = header.get("minimum_reusable_offset", header["offset"])
    if minimum > header["offset"]:
        raise SnapshotError(f"minimum_reusable_offset {minimum} exceeds offset {header['offset']}")
    return SnapshotHeader(
        format_version=version, cache_kind=header["cache_kind"], k_bits=header["k_bits"],
        v_bits=header["v_bits"], head_dim=header["head_dim"], rotation_id=header["rotation_id"],
        model_fingerprint=header["model_fingerprint"], namespace=header["namespace"],
        token_ids=tuple(header["token_ids"]), offset=header["offset"],
        minimum_reusable_offset=minimum, planes=planes, created_ns=header["created_ns"],
        extra=dict(header["extra"]),
    )
