"""Delayed TurboQuant: conversion point, precision boundary, and serial == slot batch bytes
(DelayedTurboQuantSlotsKVCache) with plain and converted rows mixed in one batch."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from tqserve.engine.attention.sdpa import MixedRowsKV, RotatedKV, turboquant_sdpa
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.delayed_slots import DelayedTurboQuantSlotsKVCache
from tqserve.engine.kv.slots import slot_batch, slot_batch_of
from tests.unit.test_kv_quant_slots import D as DIM
from tests.unit.test_kv_quant_slots import H as HEADS
from tests.unit.test_kv_quant_slots import Mirror, Planes, run_batch_scenario


def delayed_planes(cache: DelayedTurboQuantKVCache) -> Planes:
    """A single row's written planes: plain keys/values, or the four TurboQuant planes."""
    if cache.quantized is not None:
        return {n: np.array(a) for n, a in cache.quantized.written().items()}
    if cache.plain is None or cache.plain.keys is None:
        return {}
    end = cache.plain.offset
    return {"keys": np.array(cache.plain.keys[..., :end, :]),
            "values": np.array(cache.plain.values[..., :end, :])}


def _mirror(start: int) -> Mirror:
    return Mirror(lambda: DelayedTurboQuantKVCache(start, 3, 4, DIM, seed=4), delayed_planes,
                  seed=start)


@pytest.mark.parametrize("start", [0, 16, 100])
def test_serial_and_batched_delayed_rows_hold_identical_bytes(start: int) -> None:
    mirror = _mirror(start)
    run_batch_scenario(mirror)
    assert isinstance(mirror.batch, DelayedTurboQuantSlotsKVCache)
    boundaries = [mirror.serial[n].minimum_reusable_offset for n in mirror.order]
    assert mirror.batch.minimum_reusable_offsets == boundaries
    assert mirror.batch.converted == [mirror.serial[n].converted for n in mirror.order]


def test_plain_and_converted_rows_mix_in_one_batch() -> None:
    mirror = _mirror(16)
    mirror.join({"short": mirror.prefill("short", [4]), "long": mirror.prefill("long", [20]),
                 "edge": mirror.prefill("edge", [15])})
    mirror.step()  # long converts at 20; edge reaches 16 plain; short stays plain
    assert mirror.batch.converted == [False, True, False]
    assert mirror.batch.minimum_reusable_offsets == [0, 20, 0]
    mirror.check()
    mirror.step()  # edge converts at its offset 16, before this append
    assert mirror.batch.converted == [False, True, True]
    assert mirror.batch.minimum_reusable_offsets == [0, 20, 16]
    mirror.check()
    mirror.filter([2, 0])  # retire long; edge before short
    mirror.serial["edge2"] = copy.deepcopy(mirror.serial["edge"])
    mirror.join({"edge2": mirror.batch.extract(0)})  # a converted row re-admitted (a copy)
    for _ in range(12):
        mirror.step()
    assert mirror.batch.converted == [True, True, True]
    mirror.check()


def test_crossing_chunk_converts_at_its_actual_offset() -> None:
    cache = DelayedTurboQuantKVCache(16, 4, 4, DIM)
    x = mx.ones((1, HEADS, 10, DIM))
    keys, _ = cache.update_and_fetch(x, x)
    assert isinstance(keys, mx.array) and not cache.converted
    keys, _ = cache.update_and_fetch(x, x)  # 10 -> 20 crosses 16: appended plain
    assert isinstance(keys, mx.array) and keys.dtype == mx.float32 and cache.offset == 20
    assert not cache.converted and cache.minimum_reusable_offset == 0
    assert cache.trim(3) == 3  # still plain: no boundary yet
    keys, _ = cache.update_and_fetch(x[:, :, :1], x[:, :, :1])
    assert isinstance(keys, RotatedKV) and cache.converted
    assert cache.minimum_reusable_offset == 17 and cache.offset == 18


def test_trim_is_clamped_at_the_boundary_and_copies_keep_it() -> None:
    cache = DelayedTurboQuantKVCache(4, 4, 4, DIM)
    x = mx.ones((1, HEADS, 6, DIM))
    cache.update_and_fetch(x, x)
    cache.update_and_fetch(x[:, :, :3], x[:, :, :3])  # converts at 6, offset 9
    assert cache.trim(10) == 3 and cache.offset == 6
    assert cache.trim(1) == 0
    for clone in (copy.deepcopy(cache), slot_batch(cache).extract(0),
                  DelayedTurboQuantKVCache.from_state(cache.state)):
        assert clone.converted and clone.minimum_reusable_offset == 6
        assert clone.trim(5) == 0
        np.testing.assert_equal(delayed_planes(clone), delayed_planes(cache))
    batch = slot_batch_of([cache, DelayedTurboQuantKVCache(4, 4, 4, DIM)])
    assert batch.trim(2) == 0  # row 0 sits on its boundary


def test_batched_state_round_trip() -> None:
    mirror = _mirror(16)
    mirror.join({"a": mirror.prefill("a", [20]), "b": mirror.prefill("b", [3])})
    mirror.step()
    restored = DelayedTurboQuantSlotsKVCache.from_state(mirror.batch.state)
    assert restored.converted == [True, False] and restored.minimum_reusable_offsets == [20, 0]
    assert restored.offset.tolist() == mirror.batch.offset.tolist()
    for i in range(2):
        np.testing.assert_equal(delayed_planes(restored.extract(i)),
                                delayed_planes(mirror.batch.extract(i)))
    single = DelayedTurboQuantKVCache.from_state(mirror.serial["b"].state)
    np.testing.assert_equal(delayed_planes(single), delayed_planes(mirror.serial["b"]))


def test_mixed_batch_attention_equals_each_row_alone() -> None:
    mirror = _mirror(8)
    mirror.join({"a": mirror.prefill("a", [12]), "b": mirror.prefill("b", [3]),
                 "c": mirror.prefill("c", [9])})
    k, v = mirror.kv(3, 1)
    queries = mx.array(np.random.default_rng(1).standard_normal((3, 4, 1, DIM)), mx.float32)
    mask = mirror.batch.make_mask(1)
    fetched, _ = mirror.batch.update_and_fetch(k, v)
    assert isinstance(fetched, MixedRowsKV)
    assert fetched.plain_rows == (1,) and fetched.rotated_rows == (0, 2)
    out = turboquant_sdpa(queries, fetched, 0.125, mask)
    for i, name in enumerate(mirror.order):
        alone, values = mirror.serial[name].update_and_fetch(k[i : i + 1], v[i : i + 1])
        if isinstance(alone, RotatedKV):
            want = turboquant_sdpa(queries[i : i + 1], alone, 0.125, None)
        else:
            want = mx.fast.scaled_dot_product_attention(queries[i : i + 1], alone, values,
                                                        scale=0.125, mask=None)
        np.testing.assert_allclose(np.array(out[i : i + 1]), np.array(want), atol=1e-5)


def test_settings_must_match() -> None:
    a = DelayedTurboQuantKVCache(8, 4, 4, DIM, decode="auto")
    with pytest.raises(ValueError, match="different settings"):
        slot_batch_of([a, DelayedTurboQuantKVCache(9, 4, 4, DIM)])
    with pytest.raises(ValueError, match="different settings"):
        slot_batch_of([a]).extend(
            slot_batch_of([DelayedTurboQuantKVCache(8, 4, 4, DIM, decode="unfused")]))
    with pytest.raises(ValueError, match=">= 0"):
        DelayedTurboQuantKVCache(-1, 4, 4, DIM)
