"""TurboQuant caches: serial == slot batch bytes (TurboQuantSlotsKVCache) through every batch
operation, a right-padded block trimmed back to each row's own length, memory, state,
conversion, and the factory's bits spec."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from tqserve.engine.kv.factory import parse_turboquant
from tqserve.engine.kv.turboquant import TurboQuantSlotsKVCache
from tqserve.engine.kv.slot_rows import STEP
from tqserve.engine.kv.slots import slot_batch_of
from tqserve.engine.kv.turboquant import PLANES, TurboQuantKVCache
from tests.unit.test_kv_quant_slots import D as DIM
from tests.unit.test_kv_quant_slots import H as HEADS
from tests.unit.test_kv_quant_slots import Mirror, Planes, run_batch_scenario


def tq_planes(cache: TurboQuantKVCache) -> Planes:
    """A single row's written planes."""
    return {n: np.array(a) for n, a in cache.written().items()}


@pytest.mark.parametrize("bits", [(4, 4), (3, 5), (8, 1)])
def test_serial_and_batched_rows_hold_identical_bytes(bits: tuple[int, int]) -> None:
    mirror = Mirror(lambda: TurboQuantKVCache(*bits, DIM, seed=5), tq_planes)
    run_batch_scenario(mirror)
    assert isinstance(mirror.batch, TurboQuantSlotsKVCache)


def test_stored_planes_are_codes_of_the_rotated_unit_vectors() -> None:
    cache = TurboQuantKVCache(4, 3, DIM, seed=2)
    k, v = Mirror(TurboQuantKVCache, tq_planes).kv(1, 6)
    fetched, same = cache.update_and_fetch(k, v)
    assert fetched is same
    assert sorted(cache.slots.planes()) == sorted(PLANES)
    assert (fetched.key_codes.dtype, fetched.key_norms.dtype) == (mx.uint32, mx.float16)
    assert fetched.length == 6 and fetched.ends == (6,)
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
    valid = sum(a.nbytes for a in tq.written().values())
    assert valid == tq.nbytes == STEP * heads * 2 * (dim * 4 // 8 + 2)  # codes + fp16 norm
    ratio = tq.nbytes / plain.nbytes
    assert ratio == pytest.approx(132 / 512) and ratio <= 0.27


def test_from_kv_cache_encodes_the_written_positions() -> None:
    mirror = Mirror(TurboQuantKVCache, tq_planes)
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
    mirror = Mirror(lambda: TurboQuantKVCache(4, 2, DIM, seed=3, decode="unfused"),
                    tq_planes)
    run_batch_scenario(mirror)
    for name in mirror.order:
        single = mirror.serial[name]
        restored = TurboQuantKVCache.from_state(single.state)
        assert restored.config == single.config and restored.offset == single.offset
        np.testing.assert_equal(tq_planes(restored), tq_planes(single))
    batch = TurboQuantSlotsKVCache.from_state(mirror.batch.state)
    assert batch.config == mirror.batch.config and not batch.fused_decode
    assert batch.offset.tolist() == mirror.batch.offset.tolist()
    for i in range(len(mirror.order)):
        np.testing.assert_equal(tq_planes(batch.extract(i)), tq_planes(mirror.batch.extract(i)))
    empty = TurboQuantSlotsKVCache.from_state(
        slot_batch_of([TurboQuantKVCache(4, 2, DIM), TurboQuantKVCache(4, 2, DIM)]).state)
    assert empty.empty() and empty.offset.tolist() == [0, 0]


def test_deepcopy_and_batch_ops_keep_config() -> None:
    single = TurboQuantKVCache(4, 4, DIM, seed=9, rotation="qr", decode="unfused")
    single.update_and_fetch(mx.ones((1, HEADS, 2, DIM)), mx.ones((1, HEADS, 2, DIM)))
    batch = slot_batch_of([single, copy.deepcopy(single)])
    assert batch.config == single.config
    assert batch.extract(1).config == single.config
    assert copy.deepcopy(batch).config == single.config
    other = TurboQuantKVCache(4, 4, DIM, seed=9, rotation="qr", decode="auto")
    with pytest.raises(ValueError, match="cannot combine"):
        slot_batch_of([single, other])
    with pytest.raises(ValueError, match="cannot combine"):
        batch.extend(slot_batch_of([other]))


def test_invalid_inputs_raise() -> None:
    with pytest.raises(ValueError, match="head_dim 96"):
        TurboQuantKVCache(4, 4, 96)
    with pytest.raises(ValueError, match="bits 9"):
        TurboQuantKVCache(9, 4, DIM)
    cache = TurboQuantKVCache(4, 4, DIM)
    with pytest.raises(ValueError, match="expected keys"):
        cache.update_and_fetch(mx.zeros((1, HEADS, 1, 32)), mx.zeros((1, HEADS, 1, 32)))
    batch = slot_batch_of([TurboQuantKVCache(4, 4, DIM), TurboQuantKVCache(4, 4, DIM)])
    with pytest.raises(ValueError, match=r"expected keys and values \(2, "):
        batch.update_and_fetch(mx.zeros((3, HEADS, 1, DIM)), mx.zeros((3, HEADS, 1, DIM)))


def test_right_padded_block_trimmed_back_matches_unpadded_rows() -> None:
    """A prefill group's chunk: both rows write a 6-position block, row 0's last two are
    padding; trimming each row back to its own length leaves the bytes of rows written
    alone without padding (engine/prefill.py)."""
    k, v = Mirror(TurboQuantKVCache, tq_planes).kv(2, 6)
    batch = slot_batch_of([TurboQuantKVCache(4, 4, DIM), TurboQuantKVCache(4, 4, DIM)])
    batch.update_and_fetch(k, v)
    batch.trim_rows([2, 0])
    singles = [TurboQuantKVCache(4, 4, DIM) for _ in range(2)]
    singles[0].update_and_fetch(k[:1, :, :4], v[:1, :, :4])
    singles[1].update_and_fetch(k[1:], v[1:])
    assert batch.offset.tolist() == [4, 6] and batch.fetch().ends == (4, 6)
    for i, single in enumerate(singles):
        np.testing.assert_equal(tq_planes(batch.extract(i)), tq_planes(single))


@pytest.mark.parametrize("spec, bits", [("k4v4", (4, 4)), ("k8v3", (8, 3)), ("K1V8", (1, 8))])
def test_parse_turboquant(spec: str, bits: tuple[int, int]) -> None:
    assert parse_turboquant(spec) == bits


@pytest.mark.parametrize("spec", ["k9v4", "k0v4", "k4", "4v4", "k4v4x", ""])
def test_parse_turboquant_refuses(spec: str) -> None:
    with pytest.raises(ValueError, match=repr(spec).replace("\\", "\\\\")):
        parse_turboquant(spec)

