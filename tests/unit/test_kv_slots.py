"""Plain KV in per-row slots: same attention inputs as BatchKVCache, joins and retirements
that move only their own rows, per-row trim."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from tqserve.engine.kv.slots import RowSlotsKVCache, retire_order, slot_batch_of

H, D = 2, 8


def _row(length, seed):
    cache = KVCache()
    k = mx.random.normal((1, H, length, D), key=mx.random.key(seed))
    cache.update_and_fetch(k, k * 2)
    return cache


def _valid(slots, i):
    return slots.keys[i, :, :slots.lengths[i]], slots.values[i, :, :slots.lengths[i]]


def test_retire_order_moves_only_last_rows_into_holes():
    assert retire_order(5, [1]) == [0, 4, 2, 3]
    assert retire_order(5, [3, 4]) == [0, 1, 2]
    assert retire_order(5, [0, 4]) == [3, 1, 2]
    assert retire_order(1, [0]) == []


def test_join_retire_and_trim_rows_keep_each_rows_kv():
    rows = [_row(n, i) for i, n in enumerate((3, 7, 5))]
    slots = RowSlotsKVCache.merge(rows[:1])
    slots.extend(slot_batch_of(rows[1:]))  # a prefill group's slot batch joins
    assert slots.lengths == [3, 7, 5]
    for i, row in enumerate(rows):
        assert mx.array_equal(_valid(slots, i)[0], row.keys[0, :, :row.offset])
        assert mx.array_equal(_valid(slots, i)[1], row.values[0, :, :row.offset])
    # one decode step: row i's new position lands at its own length
    new = mx.ones((3, H, 1, D))
    keys, _ = slots.update_and_fetch(new, new)
    assert keys.shape == (3, H, 8, D) and slots.lengths == [4, 8, 6]
    assert slots.offset.tolist() == [4, 8, 6]
    for i, p in enumerate((3, 7, 5)):
        assert mx.array_equal(slots.keys[i, :, p], mx.ones((H, D)))
    mask = slots.make_mask(1)
    assert mask.shape == (3, 1, 1, 9) and mask[0, 0, 0].tolist() == [True] * 5 + [False] * 4
    # retire row 0: row 2 moves into slot 0, row 1 stays where it is
    before = _valid(slots, 1)[0]
    slots.filter(retire_order(3, [0]))
    assert slots.lengths == [6, 8]
    assert mx.array_equal(_valid(slots, 1)[0], before)
    assert mx.array_equal(slots.keys[0, :, :5], rows[2].keys[0, :, :5])
    # per-row rollback: nothing moves
    assert slots.trim_rows([2, 0]) == [2, 0] and slots.lengths == [4, 8]
    assert slots.trim_rows([9, 1]) == [4, 1] and slots.lengths == [0, 7]
    with pytest.raises(ValueError, match="trim amounts"):
        slots.trim_rows([1])
    extracted = slots.extract(1)
    assert extracted.offset == 7 and mx.array_equal(extracted.keys[0], rows[1].keys[0, :, :7])


def test_block_of_positions_matches_batch_kv_cache_attention():
    """A 3-position block (speculative verify) sees exactly what BatchKVCache shows."""
    rows = [_row(n, 10 + i) for i, n in enumerate((4, 6))]
    slots = RowSlotsKVCache.merge(rows)
    batch = BatchKVCache.merge([_row(4, 10), _row(6, 11)])
    block = mx.random.normal((2, H, 3, D), key=mx.random.key(3))
    q = mx.random.normal((2, H, 3, D), key=mx.random.key(4))
    mask_s = slots.make_mask(3)
    k_s, v_s = slots.update_and_fetch(block, block)
    mask_b = batch.make_mask(3, return_array=True)
    k_b, v_b = batch.update_and_fetch(block, block)
    out_s = mx.fast.scaled_dot_product_attention(q, k_s, v_s, scale=0.3, mask=mask_s)
    out_b = mx.fast.scaled_dot_product_attention(q, k_b, v_b, scale=0.3, mask=mask_b)
    assert mx.allclose(out_s, out_b, atol=1e-5)


def test_rows_with_no_position_yet_join_and_then_decode():
    """A one-token prompt joins with an empty cache (it prefilled nothing)."""
    slots = RowSlotsKVCache.merge([KVCache()])
    assert slots.lengths == [0] and slots.nbytes == 0
    slots.extend(_row(3, 5))
    slots.extend(KVCache())
    assert slots.lengths == [0, 3, 0]
    new = mx.ones((3, H, 1, D))
    keys, _ = slots.update_and_fetch(new, new)
    assert keys.shape == (3, H, 4, D) and slots.lengths == [1, 4, 1]
    assert mx.array_equal(slots.keys[2, :, 0], mx.ones((H, D)))
    assert slots.make_mask(1)[0, 0, 0].tolist() == [True, True, False, False, False]
