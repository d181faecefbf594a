"""The snapshot format: round trips, strict verification, corruption, version-1 headers."""

import array
import hashlib
import io
import random
import struct

import msgpack
import pytest
import zstandard

from tqserve.storage.snapshot import (MAGIC, SnapshotError, decode_header, decode_snapshot, encode_snapshot,
                              read_snapshot)


def header_fields(namespace: str = "ns-test", token_ids: tuple[int, ...] = (5, 17, 9, 3),
                  model_fingerprint: str = "fp-test") -> dict:
    """Valid `encode_snapshot` keyword arguments, planes and level aside."""
    return {
        "cache_kind": "turboquant", "k_bits": 4, "v_bits": 3, "head_dim": 64,
        "rotation_id": "hadamard-seed-7", "model_fingerprint": model_fingerprint,
        "namespace": namespace, "token_ids": token_ids, "offset": len(token_ids),
        "minimum_reusable_offset": max(0, len(token_ids) - 1), "created_ns": 1_700_000_000_000,
        "extra": {"num_layers": 2, "note": "unit", "scale": 0.5},
    }


def sample_planes(rng: random.Random) -> list[tuple[str, bytes, tuple[int, ...], str]]:
    """Planes of several dtypes; bfloat16 travels as raw bytes (the top half of float32)."""
    floats = array.array("f", (rng.uniform(-4, 4) for _ in range(2 * 3 * 8))).tobytes()
    words = array.array("I", (rng.getrandbits(32) for _ in range(5 * 7))).tobytes()
    halves = struct.pack("<24e", *(rng.uniform(-2, 2) for _ in range(24)))
    bfloat = b"".join(struct.pack("<f", rng.uniform(-1, 1))[2:] for _ in range(4 * 16))
    return [
        ("layers.0.keys", floats, (2, 3, 8), "float32"),
        ("layers.0.values", words, (5, 7), "uint32"),
        ("layers.1.keys", halves, (3, 8), "float16"),
        ("layers.1.values", bfloat, (4, 16), "bfloat16"),
        ("layers.1.empty", b"", (0, 16), "float32"),
    ]


def header_region_length(data: bytes) -> int:
    """Bytes before the first plane: magic, length, header, header checksum."""
    return 8 + 4 + struct.unpack_from("<I", data, 8)[0] + 16


def build_by_hand(fields: dict, blobs: list[bytes]) -> bytes:
    """Assemble a file from the layout spec alone, with a correct header checksum."""
    header = msgpack.packb(fields, use_bin_type=True)
    digest = hashlib.blake2b(header, digest_size=16).digest()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, digest, *blobs])


def hand_plane(name: str, data: bytes, shape: list[int], dtype: str) -> tuple[dict, bytes]:
    blob = zstandard.ZstdCompressor().compress(data)
    spec = {"name": name, "shape": shape, "dtype": dtype, "raw_len": len(data),
            "compressed_len": len(blob), "checksum": hashlib.blake2b(blob, digest_size=16).digest()}
    return spec, blob


def hand_fields(version: int, plane_specs: list[dict]) -> dict:
    fields = {"format_version": version, **header_fields(), "planes": plane_specs}
    fields["token_ids"] = list(fields["token_ids"])
    if version == 1:
        del fields["minimum_reusable_offset"]
    return fields


@pytest.fixture
def encoded() -> bytes:
    return encode_snapshot(**header_fields(), planes=sample_planes(random.Random(0)))


def test_round_trip_preserves_plane_bytes_and_header(tmp_path):
    planes = sample_planes(random.Random(1))
    path = tmp_path / "one.tqsnap"
    path.write_bytes(encode_snapshot(**header_fields(), planes=planes))

    header, decoded = read_snapshot(path)

    assert list(decoded) == [name for name, *_ in planes]
    for name, data, shape, dtype in planes:
        assert decoded[name].data == data
        assert decoded[name].shape == shape
        assert decoded[name].dtype == dtype
    expected = header_fields()
    assert header.format_version == 2
    for field, value in expected.items():
        assert getattr(header, field) == value, field
    assert [(p.name, p.shape, p.dtype, p.raw_len) for p in header.planes] == [
        (name, shape, dtype, len(data)) for name, data, shape, dtype in planes]
    with open(path, "rb") as file:
        assert decode_header(file) == header
    assert decode_header(path.read_bytes()) == header


def test_zstd_level_is_applied_and_both_levels_decode():
    text = b"".join(b"token %d attends to token %d\n" % (i, i // 3) for i in range(4000))
    planes = [("layers.0.keys", text, (len(text),), "uint8")]
    fast = encode_snapshot(**header_fields(), planes=planes, level=1)
    small = encode_snapshot(**header_fields(), planes=planes, level=19)
    assert len(small) < len(fast) < len(text)
    assert decode_snapshot(fast)[1]["layers.0.keys"].data == text
    assert decode_snapshot(small)[1]["layers.0.keys"].data == text


def test_bit_flip_in_every_header_byte_is_rejected(encoded):
    for index in range(header_region_length(encoded)):
        corrupt = bytearray(encoded)
        corrupt[index] ^= 1 << (index % 8)
        with pytest.raises(SnapshotError):
            decode_snapshot(bytes(corrupt))


def test_bit_flips_in_plane_bytes_are_rejected(encoded):
    rng = random.Random(2)
    start = header_region_length(encoded)
    for index in rng.sample(range(start, len(encoded)), 50):
        corrupt = bytearray(encoded)
        corrupt[index] ^= 1 << rng.randrange(8)
        with pytest.raises(SnapshotError, match="checksum mismatch in plane"):
            decode_snapshot(bytes(corrupt))


def test_truncation_at_any_length_is_rejected(encoded):
    header = decode_header(encoded)
    boundaries = {0, 8, 12, header_region_length(encoded) - 16, header_region_length(encoded)}
    position = header_region_length(encoded)
    for spec in header.planes:
        position += spec.compressed_len
        boundaries.add(position)
    lengths = set(range(0, len(encoded), 7))
    lengths |= {edge + delta for edge in boundaries for delta in (-1, 0, 1)}
    for length in sorted(lengths & set(range(len(encoded)))):
        with pytest.raises(SnapshotError):
            decode_snapshot(encoded[:length])
    with pytest.raises(SnapshotError, match="truncated plane layers.1.empty"):
        decode_snapshot(encoded[:-1])
    empty_plane_len = header.planes[-1].compressed_len
    with pytest.raises(SnapshotError, match="truncated plane layers.1.values"):
        decode_snapshot(encoded[:-empty_plane_len - 1])


def test_trailing_bytes_are_rejected(encoded):
    with pytest.raises(SnapshotError, match="trailing"):
        decode_snapshot(encoded + b"\x00")


def test_random_multi_byte_damage_raises_only_snapshot_error(encoded):
    rng = random.Random(3)
    for _ in range(300):
        corrupt = bytearray(encoded)
        for _ in range(rng.randint(1, 8)):
            corrupt[rng.randrange(len(corrupt))] = rng.getrandbits(8)
        if bytes(corrupt) != encoded:
            with pytest.raises(SnapshotError):
                decode_snapshot(bytes(corrupt))


def test_version_1_header_uses_its_offset_as_minimum_reusable_offset(tmp_path):
    data = bytes(range(64))
    spec, blob = hand_plane("layers.0.keys", data, [16], "float32")
    path = tmp_path / "old.tqsnap"
    path.write_bytes(build_by_hand(hand_fields(1, [spec]), [blob]))

    header, planes = read_snapshot(path)

    assert header.format_version == 1
    assert header.offset == 4
    assert header.minimum_reusable_offset == 4
    assert planes["layers.0.keys"].data == data


@pytest.mark.parametrize("mutate, reason", [
    (lambda f: f.update(format_version=3), "unsupported format version 3"),
    (lambda f: f.pop("minimum_reusable_offset"), "missing"),
    (lambda f: f.update(surplus=1), "unknown"),
    (lambda f: f.update(offset="4"), "field offset"),
    (lambda f: f.update(k_bits=True), "field k_bits"),
    (lambda f: f.update(token_ids=[1, -2]), "field token_ids"),
    (lambda f: f.update(token_ids=[1, 2**32]), "field token_ids"),
    (lambda f: f.update(cache_kind="bf16"), "field cache_kind"),
    (lambda f: f.update(extra={"tags": [1, 2]}), "field extra"),
    (lambda f: f.update(minimum_reusable_offset=9), "exceeds offset"),
    (lambda f: f["planes"][0].update(dtype="float8"), "field dtype"),
    (lambda f: f["planes"][0].update(raw_len=60), "raw_len 60"),
    (lambda f: f["planes"][0].update(checksum=b"\x00" * 15), "field checksum"),
    (lambda f: f["planes"].append(dict(f["planes"][0])), "duplicate plane names"),
])
def test_strict_fields_reject_a_checksummed_but_invalid_header(mutate, reason):
    spec, blob = hand_plane("layers.0.keys", bytes(64), [16], "float32")
    fields = hand_fields(2, [spec])
    mutate(fields)
    with pytest.raises(SnapshotError, match=reason):
        decode_snapshot(build_by_hand(fields, [blob, blob]))


def test_version_1_header_with_the_new_field_is_rejected():
    spec, blob = hand_plane("layers.0.keys", bytes(64), [16], "float32")
    fields = hand_fields(1, [spec])
    fields["minimum_reusable_offset"] = 1
    with pytest.raises(SnapshotError, match="unknown"):
        decode_snapshot(build_by_hand(fields, [blob]))


def test_undecodable_header_with_valid_checksum_is_rejected():
    header = b"\xc1\x00"
    digest = hashlib.blake2b(header, digest_size=16).digest()
    with pytest.raises(SnapshotError, match="undecodable header"):
        decode_snapshot(MAGIC + struct.pack("<I", len(header)) + header + digest)
    header = msgpack.packb([1, 2])
    digest = hashlib.blake2b(header, digest_size=16).digest()
    with pytest.raises(SnapshotError, match="not a map"):
        decode_snapshot(MAGIC + struct.pack("<I", len(header)) + header + digest)


def test_plane_whose_frame_disagrees_with_raw_len_is_rejected():
    spec, blob = hand_plane("layers.0.keys", bytes(68), [16], "float32")
    spec["raw_len"] = 64
    with pytest.raises(SnapshotError, match="declares 68 bytes, expected 64"):
        decode_snapshot(build_by_hand(hand_fields(2, [spec]), [blob]))


def test_plane_that_is_not_zstd_is_rejected():
    blob = b"not a zstd frame"
    spec = {"name": "p", "shape": [4], "dtype": "float32", "raw_len": 16,
            "compressed_len": len(blob), "checksum": hashlib.blake2b(blob, digest_size=16).digest()}
    with pytest.raises(SnapshotError, match="cannot decompress plane p"):
        decode_snapshot(build_by_hand(hand_fields(2, [spec]), [blob]))


@pytest.mark.parametrize("change", [
    {"planes": [("p", bytes(10), (4,), "float32")]},
    {"planes": [("p", bytes(4), (1,), "complex64")]},
    {"planes": [("p", bytes(4), (1,), "float32"), ("p", bytes(4), (1,), "float32")]},
    {"token_ids": (1, -1)},
    {"head_dim": 0},
    {"extra": {"flag": True}},
])
def test_encode_rejects_invalid_input_with_value_error(change):
    arguments = {**header_fields(), "planes": [], **change}
    with pytest.raises(ValueError):
        encode_snapshot(**arguments)


def test_decode_header_from_a_short_file_raises_snapshot_error(encoded):
    with pytest.raises(SnapshotError, match="truncated header"):
        decode_header(io.BytesIO(encoded[:40]))
    assert decode_header(io.BytesIO(encoded)) == decode_snapshot(encoded)[0]
