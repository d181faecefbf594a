"""Per-row rollback (`trim_rows`) on every batch cache kind (the per-row slot batches):
kept bytes unchanged, rows trimmed by different amounts, bad amounts refused, a cache
without `trim_rows` refused by name; delayed TurboQuant's boundary is never set by
rejected tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from tqserve.engine.kv.affine import AffineKVCache
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.slots import slot_batch_of
from tqserve.engine.kv.turboquant import TurboQuantKVCache
from tqserve.engine.speculative.rollback import trim_batch_rows, trim_rows

HEADS, DIM = 2, 64
LENGTHS = [5, 9, 3]   # committed positions per row before the verify block
BLOCK = 4             # positions every row appends in one verify step
TRIMS = [3, 0, 4]     # rejected positions per row


def _block(num_rows: int, length: int, seed: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((num_rows, HEADS, length, DIM), key=mx.random.key(seed))
    v = mx.random.normal((num_rows, HEADS, length, DIM), key=mx.random.key(seed + 1))
    return k, v


KINDS = {
    "plain": lambda: KVCache(),
    "affine": lambda: AffineKVCache(8, 64),
    "turboquant": lambda: TurboQuantKVCache(8, 3, DIM, seed=1),
    "delayed": lambda: DelayedTurboQuantKVCache(6, 8, 3, DIM, seed=1),
}


def _row_state(cache) -> list[np.ndarray]:
    if isinstance(cache, KVCache):
        return [np.array(a[..., : cache.offset, :]) for a in (cache.keys, cache.values)]
    return [np.array(a) for a in cache.state if isinstance(a, mx.array) and a.ndim == 4]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_trim_rows_keeps_exactly_the_accepted_positions(kind: str) -> None:
    make = KINDS[kind]
    rows, refs = [], []
    for i, n in enumerate(LENGTHS):
        for target in (rows, refs):
            cache = make()
            cache.update_and_fetch(*_block(1, n, 10 * i))
            target.append(cache)
    batch = slot_batch_of(rows)
    blocks = [_block(1, BLOCK, 100 + i) for i in range(len(LENGTHS))]
    batch.update_and_fetch(mx.concatenate([b[0] for b in blocks]),
                           mx.concatenate([b[1] for b in blocks]))
    trim_rows(batch, TRIMS)
    assert [int(o) for o in batch.offset.tolist()] == [
        n + BLOCK - t for n, t in zip(LENGTHS, TRIMS)]
    for i, ref in enumerate(refs):  # the same row cached alone, fed only what it kept
        keep = BLOCK - TRIMS[i]
        if keep:
            ref.update_and_fetch(blocks[i][0][:, :, :keep], blocks[i][1][:, :, :keep])
        got = _row_state(batch.extract(i))
        want = _row_state(ref)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    # the next append lands right after each row's kept positions
    batch.update_and_fetch(*_block(len(LENGTHS), 1, 7))
    assert [int(o) for o in batch.offset.tolist()] == [
        n + BLOCK - t + 1 for n, t in zip(LENGTHS, TRIMS)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_trim_rows_refuses_bad_amounts_and_changes_nothing(kind: str) -> None:
    rows = []
    for i, n in enumerate(LENGTHS):
        cache = KINDS[kind]()
        cache.update_and_fetch(*_block(1, n, i))
        rows.append(cache)
    batch = slot_batch_of(rows)
    before = [int(o) for o in batch.offset.tolist()]
    for bad in ([1, 1], [0, 0, 99], [-1, 0, 0]):
        with pytest.raises(ValueError):
            trim_rows(batch, bad)
        assert [int(o) for o in batch.offset.tolist()] == before
    with pytest.raises(TypeError):
        trim_batch_rows([object()], [0])


def test_delayed_rejected_tokens_never_set_the_boundary() -> None:
    """Row 0 is plain at 4 < start 6: its verify block of 4 crosses the threshold, 3 are
    rejected, so it holds 5 and stays plain (boundary 0); it converts at its retained
    offset only at a later append. Row 1 (offset 7 >= start) converts from committed
    history before the verify block (boundary 7), and rollback never goes below it."""
    rows = []
    for i, n in enumerate((4, 7)):
        cache = DelayedTurboQuantKVCache(6, 8, 3, DIM, seed=1)
        cache.update_and_fetch(*_block(1, n, i))
        rows.append(cache)
    assert [r.converted for r in rows] == [False, False]
    batch = slot_batch_of(rows)
    batch.update_and_fetch(*_block(2, BLOCK, 50))  # the verify block
    assert batch.converted == [False, True]
    assert batch.minimum_reusable_offsets == [0, 7]
    trim_rows(batch, [3, 2])
    assert batch.lengths == [5, 9]
    assert batch.converted == [False, True] and batch.minimum_reusable_offsets == [0, 7]
    with pytest.raises(ValueError):
        trim_rows(batch, [0, 3])  # would cut below row 1's boundary
    batch.update_and_fetch(*_block(2, 1, 60))  # row 0 at 5: still below start
    assert batch.converted == [False, True]
    batch.update_and_fetch(*_block(2, 1, 61))  # row 0 at 6: converts now, at 6
    assert batch.converted == [True, True]
    assert batch.minimum_reusable_offsets == [6, 7]


def test_a_cache_without_trim_rows_is_refused_by_name() -> None:
    batch = BatchKVCache([2, 0])  # mlx-lm's padded batch (no longer used here): no trim_rows
    batch.update_and_fetch(*_block(2, 6, 3))
    with pytest.raises(TypeError, match="BatchKVCache cannot roll back rows one by one"):
        trim_rows(batch, [1, 3])
    assert batch.offset.tolist() == [4, 6]
