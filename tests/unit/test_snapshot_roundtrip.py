"""Every snapshot cache kind round-trips: caches -> planes -> snapshot file -> caches.

For plain KVCache (float32 and bfloat16), TurboQuantKVCache, DelayedTurboQuantKVCache before
and after its conversion, and AffineKVCache: a single row is put into its slot batch
(`slot_batch`, as prefill groups and the decode batch hold rows) and extracted back as
engine.snapshot does for a finished row, turned into planes (`to_planes`), written through
storage (SsdTier.put: zstd, checksums, crash-safe file), read back and fully verified, its
header fields checked, rebuilt against a fresh template (`from_planes`), and its planes
compared byte for byte. The rebuilt row must also be usable: reused by reference at every
allowed length and extended by one more token.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from tqserve.engine.kv.affine import AffineKVCache
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.slots import slot_batch
from tqserve.engine.kv.turboquant import TurboQuantKVCache
from tqserve.engine.snapshot import (describe, extract_snapshot, from_planes, layer_kinds_text,
                             row_from_snapshot, to_planes)
from tqserve.storage import SsdTier, snapshot_key

HEADS, HEAD_DIM = 2, 64
START = 6  # quantized_kv_start of the delayed caches


def fill(cache, lengths, dtype=mx.float32, seed=0):
    """Append random K/V blocks of the given lengths, one update each."""
    key = mx.random.key(seed)
    for length in lengths:
        key, k1, k2 = mx.random.split(key, 3)
        shape = (1, HEADS, length, HEAD_DIM)
        cache.update_and_fetch(mx.random.normal(shape, key=k1).astype(dtype),
                               mx.random.normal(shape, key=k2).astype(dtype))
    return cache


def tq_factory():
    return TurboQuantKVCache(4, 3, HEAD_DIM)


def delayed_factory():
    return DelayedTurboQuantKVCache(START, 4, 4, HEAD_DIM)


def affine_factory():
    return AffineKVCache(4, 32)


PLAIN_FIELDS = dict(cache_kind="kv", k_bits=None, v_bits=None, rotation_id=None)
# kind -> (template factory, block lengths, dtype, header fields, layer kind, offset, boundary)
CASES = {
    "kv": (KVCache, [5, 3], mx.float32, PLAIN_FIELDS, "kv", 8, 0),
    "kv-bf16": (KVCache, [5, 3], mx.bfloat16, PLAIN_FIELDS, "kv", 8, 0),
    "turboquant": (tq_factory, [5, 3], mx.float32,
                   dict(cache_kind="turboquant", k_bits=4, v_bits=3), "tq", 8, 0),
    # 3 + 2 = 5 < START: still plain.
    "delayed-plain": (delayed_factory, [3, 2], mx.float32,
                      dict(cache_kind="turboquant", k_bits=4, v_bits=4), "dplain", 5, 0),
    # 4 + 3 = 7 >= START: the third block converts first, so the boundary is 7.
    "delayed-converted": (delayed_factory, [4, 3, 2], mx.float32,
                          dict(cache_kind="turboquant", k_bits=4, v_bits=4), "dtq", 9, 7),
    "affine": (affine_factory, [5, 3], mx.float32,
               dict(cache_kind="affine", k_bits=4, v_bits=4, rotation_id=None), "affine", 8, 0),
}


@pytest.mark.parametrize("kind", CASES)
def test_snapshot_round_trips_through_storage(kind, tmp_path):
    factory, lengths, dtype, want_fields, layer_kind, offset, boundary = CASES[kind]
    num_layers = 2
    rows = [fill(factory(), lengths, dtype, seed=layer) for layer in range(num_layers)]
    snapshot = extract_snapshot([slot_batch(c) for c in rows], 0)
    assert snapshot is not None
    assert snapshot.kinds == (layer_kind,) * num_layers
    assert snapshot.offset == offset
    assert snapshot.minimum_reusable_offset == boundary
    planes = to_planes(snapshot)

    tokens = tuple(range(100, 100 + snapshot.offset))
    tier = SsdTier(tmp_path, 1 << 30, expected_fingerprints=["fp"])
    tier.recover()
    key = snapshot_key("ns", tokens)
    fields = {**describe(snapshot), "offset": snapshot.offset,
              "minimum_reusable_offset": snapshot.minimum_reusable_offset,
              "extra": {"layer_kinds": layer_kinds_text(snapshot)},
              "model_fingerprint": "fp", "namespace": "ns", "token_ids": tokens,
              "created_ns": 1}
    tier.put(key, fields, planes)
    again = SsdTier(tmp_path, 1 << 30, expected_fingerprints=["fp"])
    assert again.recover().num_loaded == 1
    header, stored = again.get(key)

    for name, value in {**want_fields, "head_dim": HEAD_DIM}.items():
        assert getattr(header, name) == value, name
    if header.cache_kind == "turboquant":
        assert header.rotation_id and ":" in header.rotation_id
    assert header.offset == snapshot.offset and header.token_ids == tokens
    assert header.minimum_reusable_offset == boundary
    assert header.extra["layer_kinds"] == ",".join([layer_kind] * num_layers)
    assert [(p.name, p.shape, p.dtype) for p in header.planes] == \
        [(name, tuple(shape), dtype) for name, _, shape, dtype in planes]

    restored = from_planes([factory() for _ in range(num_layers)],
                           str(header.extra["layer_kinds"]), header.offset,
                           header.minimum_reusable_offset,
                           {name: (p.data, p.shape, p.dtype) for name, p in stored.items()})
    assert restored.kinds == snapshot.kinds
    assert restored.offset == snapshot.offset
    assert restored.minimum_reusable_offset == boundary
    assert [(n, d, tuple(s), t) for n, d, s, t in to_planes(restored)] == \
        [(n, d, tuple(s), t) for n, d, s, t in planes]
    for layer in restored.layers:
        assert getattr(layer, "minimum_reusable_offset", 0) == boundary

    # Usable: reused at every allowed length, then extended by one position.
    for length in range(boundary or 1, restored.offset + 1):
        caches = row_from_snapshot(restored, length)
        assert all(int(c.offset) == length for c in caches)
    if boundary:
        with pytest.raises(ValueError):
            row_from_snapshot(restored, boundary - 1)
    caches = row_from_snapshot(restored, restored.offset)
    for cache in caches:
        fill(cache, [1], seed=9)
        assert int(cache.offset) == restored.offset + 1
    assert to_planes(restored) == planes  # the snapshot itself was never written


def test_affine_header_names_the_real_head_dim():
    snapshot = extract_snapshot([slot_batch(fill(AffineKVCache(8, 64), [4]))], 0)
    assert describe(snapshot)["head_dim"] == HEAD_DIM
    snapshot = extract_snapshot([slot_batch(fill(AffineKVCache(4, 32), [4]))], 0)
    assert describe(snapshot)["head_dim"] == HEAD_DIM


def test_delayed_snapshot_of_a_plain_row_restores_into_a_converted_engine_row():
    """A dplain file is accepted by a delayed template (and stays plain until START)."""
    row = fill(delayed_factory(), [3, 2])
    snapshot = extract_snapshot([slot_batch(row)], 0)
    planes = {n: (d, s, t) for n, d, s, t in to_planes(snapshot)}
    restored = from_planes([delayed_factory()], "dplain", snapshot.offset, 0, planes)
    (cache,) = row_from_snapshot(restored, snapshot.offset)
    fill(cache, [1], seed=3)
    fill(cache, [1], seed=4)  # the offset reached START: this update converts
    assert cache.converted and cache.minimum_reusable_offset == START
