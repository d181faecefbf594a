"""TurboQuant caches: serial == batched bytes through every batch operation, memory, state,
conversion, and the factory's bits spec."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from tqserve.engine.kv.factory import parse_turboquant
from tqserve.engine.kv.rows import STEP
from tqserve.engine.kv.turboquant import PLANES, BatchedTurboQuantKVCache, TurboQuantKVCache

HEADS = 2
DIM = 64
Planes = dict[str, np.ndarray]


def tq_planes(cache: TurboQuantKVCache) -> Planes:
    """A single row's written planes."""
    return {n: np.array(a) for n, a in cache.rows.valid_planes().items()}


def tq_batch_row(batch: BatchedTurboQuantKVCache, i: int) -> Planes:
    """Row i of a batch, read from the valid region past its left padding."""
    start = batch.rows.left_padding[i]
    return {n: np.array(a[i : i + 1, :, start:]) for n, a in batch.rows.valid_planes().items()}


class Mirror:
    """Serial single-row caches next to one batch cache, fed the same K/V."""

    def __init__(self, make: Callable[[], Any], single: Callable[[Any], Planes],
                 batch_row: Callable[[Any, int], Planes], seed: int = 0) -> None:
        self.make, self.single, self.batch_row = make, single, batch_row
        self.rng = np.random.default_rng(seed)
        self.serial: dict[str, Any] = {}
        self.order: list[str] = []
        self.batch: Any = None

    def kv(self, num_rows: int, length: int) -> tuple[mx.array, mx.array]:
        shape = (num_rows, HEADS, length, DIM)
        scale = self.rng.uniform(0.1, 30.0, (num_rows, HEADS, length, 1))
        k, v = (self.rng.standard_normal(shape) * scale for _ in range(2))
        return mx.array(k.astype(np.float32)), mx.array(v.astype(np.float32))

    def prefill(self, name: str, chunks: list[int]) -> Any:
        """A serial row and its twin (returned, for the batch), fed the same chunks."""
        serial, twin = self.make(), self.make()
        for length in chunks:
            k, v = self.kv(1, length)
            serial.update_and_fetch(k, v)
            twin.update_and_fetch(k, v)
        self.serial[name] = serial
        return twin

    def join(self, rows: dict[str, Any]) -> None:
        """Merge single rows (twins or extracted rows) into the batch."""
        singles = list(rows.values())
        merged = type(singles[0]).merge(singles)
        if self.batch is None:
            self.batch = merged
        else:
            self.batch.extend(merged)
        self.order += list(rows)

    def step(self, length: int = 1) -> None:
        k, v = self.kv(len(self.order), length)
        self.batch.update_and_fetch(k, v)
        for i, name in enumerate(self.order):
            self.serial[name].update_and_fetch(k[i : i + 1], v[i : i + 1])

    def filter(self, keep: list[int]) -> None:
        self.batch.filter(keep)
        self.order = [self.order[i] for i in keep]
        assert min(self.batch.left_padding.tolist()) == 0  # shared padding shifted away

    def trim(self, n: int) -> int:
        trimmed = self.batch.trim(n)
        assert [self.serial[name].trim(trimmed) for name in self.order] == [trimmed] * len(
            self.order)
        return trimmed

    def check(self) -> None:
        """Every batch row holds the serial row's bytes, at the serial row's offset."""
        assert self.batch.offset.tolist() == [self.serial[n].offset for n in self.order]
        for i, name in enumerate(self.order):
            want, got = self.single(self.serial[name]), self.batch_row(self.batch, i)
            assert set(want) == set(got), name
            for plane in want:
                assert want[plane].dtype == got[plane].dtype, (name, plane)
                np.testing.assert_array_equal(got[plane], want[plane], err_msg=f"{name} {plane}")


def run_batch_scenario(mirror: Mirror) -> None:
    """Merge, decode, join, reorder + retire, extract + re-admit, trim, multi-token steps."""
    mirror.join({"a": mirror.prefill("a", [5]), "b": mirror.prefill("b", [7, 6])})
    mirror.check()
    for _ in range(4):
        mirror.step()
    mirror.check()
    mirror.join({"c": mirror.prefill("c", [3, 9, 12])})
    mirror.step()
    mirror.check()
    mirror.filter([2, 0])  # retire b, reorder c before a
    mirror.step()
    mirror.check()
    row = mirror.batch.extract(1)  # a leaves; decodes alone for a while; comes back
    mirror.filter([0])
    np.testing.assert_equal(mirror.single(row), mirror.single(mirror.serial["a"]))
    mirror.step()
    for _ in range(2):
        k, v = mirror.kv(1, 1)
        row.update_and_fetch(k, v)
        mirror.serial["a"].update_and_fetch(k, v)
    mirror.join({"a": row})
    mirror.step()
    mirror.check()
    assert mirror.trim(2) == 2
    mirror.check()
    mirror.step(3)  # a multi-token block (e.g. speculative verification)
    mirror.check()
    room = min(mirror.serial[n].offset - getattr(mirror.serial[n], "minimum_reusable_offset", 0)
               for n in mirror.order)
    assert mirror.trim(100) == room  # clamped: the shortest row, or a precision boundary
    mirror.check()


@pytest.mark.parametrize("bits", [(4, 4), (3, 5), (8, 1)])
def test_serial_and_batched_rows_hold_identical_bytes(bits: tuple[int, int]) -> None:
    mirror = Mirror(lambda: TurboQuantKVCache(*bits, DIM, seed=5), tq_planes, tq_batch_row)
    run_batch_scenario(mirror)
    assert isinstance(mirror.batch, BatchedTurboQuantKVCache)


def test_stored_planes_are_codes_of_the_rotated_unit_vectors() -> None:
    cache = TurboQuantKVCache(4, 3, DIM, seed=2)
    k, v = Mirror(TurboQuantKVCache, tq_planes, tq_batch_row).kv(1, 6)
    fetched, same = cache.update_and_fetch(k, v)
    assert fetched is same
    assert sorted(cache.rows.planes) == sorted(PLANES)
    assert (fetched.key_codes.dtype, fetched.key_norms.dtype) == (mx.uint32, mx.float16)
    assert fetched.length == 6 and fetched.left_padding == (0,)
    written = dict(zip(PLANES, fetched.written()))
    for codes, norms, codec, x in (("key_codes", "key_norms", cache.config.key_codec, k),
                                   ("value_codes", "value_norms", cache.config.value_codec, v)):
        encoded = codec.encode(x)
        np.testing.assert_array_equal(np.array(written[codes]), np.array(encoded.codes))
        np.testing.assert_array_equal(np.array(written[norms]), np.array(encoded.norms))
        unit = x / mx.linalg.norm(x, axis=-1, keepdims=True)
        rotated = codec.rotate(unit)
        centroids = mx.array(codec.codebook.centroids, dtype=mx.float32)
        nearest = mx.argmin(mx.abs(rotated[..., None] - centroids), axis=-1)
        direct = codec.decode_rotated(encoded) / encoded.norms.astype(mx.float32)
        np.testing.assert_allclose(np.array(direct), np.array(centroids[nearest]), atol=1e-6)


def test_resident_bytes_per_token_k4v4_at_most_027_of_bf16() -> None:
    """Both caches allocate in steps of 256 positions; at 256 tokens allocation == valid."""
    heads, dim = 8, 128
    tq = TurboQuantKVCache(4, 4, dim)
    plain = KVCache()
    x = mx.random.normal((1, heads, STEP, dim))
    tq.update_and_fetch(x, x)
    plain.update_and_fetch(x.astype(mx.bfloat16), x.astype(mx.bfloat16))
    valid = sum(a.nbytes for a in tq.rows.valid_planes().values())
    assert valid == tq.nbytes == STEP * heads * 2 * (dim * 4 // 8 + 2)  # codes + fp16 norm
    ratio = tq.nbytes / plain.nbytes
    assert ratio == pytest.approx(132 / 512) and ratio <= 0.27


def test_from_kv_cache_encodes_the_written_positions() -> None:
    mirror = Mirror(TurboQuantKVCache, tq_planes, tq_batch_row)
    plain = KVCache()
    direct = TurboQuantKVCache(3, 3, DIM, seed=1)
    for length in (4, 3):
        k, v = mirror.kv(1, length)
        plain.update_and_fetch(k, v)
        direct.update_and_fetch(k, v)
    converted = TurboQuantKVCache.from_kv_cache(plain, 3, 3, seed=1)
    assert converted.offset == 7
    np.testing.assert_equal(tq_planes(converted), tq_planes(direct))
    assert TurboQuantKVCache.from_kv_cache(KVCache(), 4, 4, head_dim=DIM).empty()
    with pytest.raises(ValueError, match="head_dim"):
        TurboQuantKVCache.from_kv_cache(KVCache(), 4, 4)
    with pytest.raises(TypeError, match="KVCache"):
        TurboQuantKVCache.from_kv_cache(converted, 4, 4)  # type: ignore[arg-type]


def test_state_round_trip_single_and_batched() -> None:
    mirror = Mirror(lambda: TurboQuantKVCache(4, 2, DIM, seed=3, fused_decode=False),
                    tq_planes, tq_batch_row)
    run_batch_scenario(mirror)
    for name in mirror.order:
        single = mirror.serial[name]
        restored = TurboQuantKVCache.from_state(single.state)
        assert restored.config == single.config and restored.offset == single.offset
        np.testing.assert_equal(tq_planes(restored), tq_planes(single))
    batch = BatchedTurboQuantKVCache.from_state(mirror.batch.state)
    assert batch.config == mirror.batch.config and not batch.fused_decode
    assert batch.offset.tolist() == mirror.batch.offset.tolist()
    for i in range(len(mirror.order)):
        np.testing.assert_equal(tq_batch_row(batch, i), tq_batch_row(mirror.batch, i))
    empty = BatchedTurboQuantKVCache.from_state(BatchedTurboQuantKVCache(4, 2, DIM, [0, 0]).state)
    assert empty.empty() and empty.offset.tolist() == [0, 0]


def test_deepcopy_and_batch_ops_keep_config() -> None:
    single = TurboQuantKVCache(4, 4, DIM, seed=9, rotation="qr", fused_decode=False)
    single.update_and_fetch(mx.ones((1, HEADS, 2, DIM)), mx.ones((1, HEADS, 2, DIM)))
    batch = TurboQuantKVCache.merge([single, copy.deepcopy(single)])
    assert batch.config == single.config
    assert batch.extract(1).config == single.config
    assert copy.deepcopy(batch).config == single.config
    other = TurboQuantKVCache(4, 4, DIM, seed=9, rotation="qr", fused_decode=True)
    with pytest.raises(ValueError, match="cannot combine"):
        TurboQuantKVCache.merge([single, other])
    with pytest.raises(ValueError, match="cannot combine"):
        batch.extend(TurboQuantKVCache.merge([other]))


def test_invalid_inputs_raise() -> None:
    with pytest.raises(ValueError, match="head_dim 96"):
        TurboQuantKVCache(4, 4, 96)
    with pytest.raises(ValueError, match="bits 9"):
        TurboQuantKVCache(9, 4, DIM)
    cache = TurboQuantKVCache(4, 4, DIM)
    with pytest.raises(ValueError, match="expected keys"):
        cache.update_and_fetch(mx.zeros((1, HEADS, 1, 32)), mx.zeros((1, HEADS, 1, 32)))
    batch = BatchedTurboQuantKVCache(4, 4, DIM, [0, 0])
    with pytest.raises(ValueError, match="block of 3 rows"):
        batch.update_and_fetch(mx.zeros((3, HEADS, 1, DIM)), mx.zeros((3, HEADS, 1, DIM)))


def test_prepare_finalize_match_unpadded_rows() -> None:
    mirror = Mirror(TurboQuantKVCache, tq_planes, tq_batch_row)
    k, v = mirror.kv(2, 6)
    batch = BatchedTurboQuantKVCache(4, 4, DIM, [0, 0])
    batch.prepare(lengths=[4, 6], right_padding=[2, 0])
    batch.update_and_fetch(k, v)
    batch.finalize()
    single = TurboQuantKVCache(4, 4, DIM)
    single.update_and_fetch(k[:1, :, :4], v[:1, :, :4])
    assert batch.offset.tolist() == [4, 6] and batch.left_padding.tolist() == [2, 0]
    np.testing.assert_equal(tq_batch_row(batch, 0), tq_planes(single))


@pytest.mark.parametrize("spec, bits", [("k4v4", (4, 4)), ("k8v3", (8, 3)), ("K1V8", (1, 8))])
def test_parse_turboquant(spec: str, bits: tuple[int, int]) -> None:
    assert parse_turboquant(spec) == bits


@pytest.mark.parametrize("spec", ["k9v4", "k0v4", "k4", "4v4", "k4v4x", ""])
def test_parse_turboquant_refuses(spec: str) -> None:
    with pytest.raises(ValueError, match=repr(spec).replace("\\", "\\\\")):
        parse_turboquant(spec)

