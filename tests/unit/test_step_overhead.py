"""Per-step host work: the ops a decode step builds. Rows of equal length (a single row,
a burst of equal prompts) decode in slots with no more ops than mlx-lm's KVCache (one
slice update per layer, no mask); uneven rows with fewer than mlx-lm's BatchKVCache."""

import io
import re

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from tqserve.engine.kv.slots import RowSlotsKVCache

H, D = 2, 8


def _row(length: int, seed: int) -> KVCache:
    cache = KVCache()
    k = mx.random.normal((1, H, length, D), key=mx.random.key(seed))
    cache.update_and_fetch(k, k * 2)
    return cache


def test_equal_lengths_decode_without_a_mask_and_attend_the_same():
    equal = RowSlotsKVCache.merge([_row(5, 1), _row(5, 2)])
    assert equal.make_mask(1) is None and RowSlotsKVCache.merge([_row(3, 1)]).make_mask(1) is None
    assert equal.make_mask(2).shape == (2, 1, 2, 7)  # a block of positions keeps causality
    uneven = RowSlotsKVCache.merge([_row(5, 1), _row(3, 2)])
    assert uneven.make_mask(1).shape == (2, 1, 1, 6)
    q = mx.random.normal((2, H, 1, D), key=mx.random.key(9))
    keys, values = equal.update_and_fetch(q, q)
    full = mx.ones((2, 1, 1, keys.shape[2]), dtype=mx.bool_)
    plain = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.5, mask=None)
    masked = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.5, mask=full)
    assert mx.array_equal(plain, masked)


def test_single_row_slots_decode_matches_mlx_lm_bit_for_bit(draft_model):
    """One row in slots (no mask) against mlx-lm's own KVCache: equal logits, 8 steps."""
    model = draft_model.model
    prompt = mx.array([[5, 17, 301, 42, 7, 99, 1000, 12]])
    ref = make_prompt_cache(model)
    model(prompt, cache=ref)
    single = make_prompt_cache(model)
    model(prompt, cache=single)
    slots = [RowSlotsKVCache.merge([c]) for c in single]
    token = mx.array([[3]])
    for _ in range(8):
        want = model(token, cache=ref)[:, -1]
        got = model(token, cache=slots)[:, -1]
        assert mx.array_equal(want, got)
        token = mx.argmax(want, axis=-1)[:, None]


def _num_ops(arrays: list[mx.array]) -> int:
    """Primitives in the lazy graph of `arrays` (each a kernel or view MLX must build)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return len(re.findall(r"shape=rectangle", dot.getvalue()))


def _prefilled(model, lengths):
    rows = []
    for i, n in enumerate(lengths):
        cache = make_prompt_cache(model)
        model(mx.array([[(7 * i + j) % 500 + 2 for j in range(n)]]), cache=cache)
        mx.eval([c.state for c in cache])
        rows.append(cache)
    return rows


def _decode_ops(model, cache, num_rows: int) -> int:
    logits = model(mx.array([[5]] * num_rows), cache=cache)[:, -1]
    return _num_ops([logits, *[a for c in cache for a in (c.keys, c.values)]])


def test_a_decode_step_in_slots_builds_no_more_ops_than_mlx_lm(draft_model):
    model = draft_model.model
    mx.eval(model.parameters())

    def slots(rows):
        out = [RowSlotsKVCache.merge([r[layer] for r in rows]) for layer in range(len(rows[0]))]
        mx.eval([a for c in out for a in (c.keys, c.values)])
        return out

    (single,) = _prefilled(model, [12])
    assert _decode_ops(model, slots([single]), 1) <= _decode_ops(model, single, 1)
    ours = {}
    for lengths in ([12] * 4, [12, 9, 15, 4]):
        rows = _prefilled(model, lengths)
        ours[len(set(lengths))] = _decode_ops(model, slots(rows), 4)
        batch = [BatchKVCache.merge([r[layer] for r in rows]) for layer in range(len(rows[0]))]
        theirs = _decode_ops(model, batch, 4)
        assert ours[len(set(lengths))] < theirs, (lengths, ours, theirs)
    # equal lengths: the ops of a single row; uneven ones add the mask and, per layer, the
    # scatter of keys and values (3 ops each, their index arrays shared by all layers)
    assert ours[1] == _decode_ops(model, slots([single]), 1)
    assert ours[4] - ours[1] <= 20 * len(single), ours
